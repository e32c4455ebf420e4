"""Drafters, one kind a file, all implementing `base.DraftSpec`."""
