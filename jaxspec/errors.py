"""The one exception type for bad input from a user: the CLI prints it as one line."""


class UserError(ValueError):
    """Bad input (shapes, ids, options, files): raised at validation, never for internal bugs."""
