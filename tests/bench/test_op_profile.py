"""`bench.op_profile` splits a computation's XLA op time into matrix products and the rest."""

import jax
import jax.numpy as jnp

from jaxspec.bench import op_profile


def _profiled(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return op_profile.trace(lambda: jax.block_until_ready(compiled(*args)),
                            lambda: [compiled.as_text()])


def test_a_product_and_an_elementwise_op_are_told_apart():
    a = jnp.ones((256, 512), jnp.float32)
    b = jnp.ones((512, 1024), jnp.float32)
    product = _profiled(lambda a, b: a @ b, a, b)
    elementwise = _profiled(lambda a, b: jnp.tanh(a) * 2.0 + jnp.exp(a), a, b)
    assert product["op_ms"] > 0 and elementwise["op_ms"] > 0
    assert product["product_share"] > 0.9
    assert elementwise["product_share"] == 0.0
    assert any("dot_general" in name for name in product["groups_ms"])
    assert "matrix products" in op_profile.format_trace(product)


def test_grouped_by_shape_two_products_stand_apart():
    a = jnp.ones((256, 512), jnp.float32)
    two = _profiled(lambda a, b, c: (a @ b, a @ c), a, jnp.ones((512, 1024)), jnp.ones((512, 96)))
    shapes = [name.split(" ", 1)[-1] for name in two["shapes_ms"]]
    assert any(s.startswith("f32[256,1024]") for s in shapes), shapes
    assert any(s.startswith("f32[256,96]") for s in shapes), shapes
