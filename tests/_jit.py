"""How many programs a jitted function holds, for the tests that assert a training loop compiles once."""

import jax


def compilations(jitted) -> int:
  """The entries of `jax.jit`'s cache for `jitted`: one per argument signature it was called with.

  A signature is the arguments' shapes, dtypes and weak types, their shardings, and whether each is
  a NumPy array; a new one compiles a program of its own (a NumPy array in place of a device array
  only takes an entry), so 1 after a loop means it compiled once.

  No public JAX API reads this count. Counting traces (`chex.assert_max_traces`) is public but not
  the same: an argument committed to a device compiles a second program from the first trace (jax
  0.10.2: `jit(f)` on `jnp.ones(3)`, then on `jax.device_put(jnp.ones(3), device)`, traces once and
  compiles twice). So this reads jit's private `_cache_size()`, which every JAX the tests run on has
  (the nox sessions run them on the oldest and the newest supported). On a release without it,
  every test that asks fails here, saying so, rather than passing unchecked.
  """
  cache_size = getattr(jitted, "_cache_size", None)
  if cache_size is None:
    raise NotImplementedError(
        f"jax {jax.__version__}'s `jax.jit` has no `_cache_size()`: count the compilations in "
        "tests/_jit.py another way (`jax.log_compiles()` logs each one, with the function's name)."
    )
  return cache_size()
