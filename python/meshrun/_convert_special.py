"""Special functions in meshrun._convert, computed as jax.jit computes them: each is traced from a
Python implementation into the program's own ops (element-wise ops, SELECTs, and while loops
unrolled to ``while_trips`` iterations and checked), so its results are jax.jit's to f32 rounding.

  - Those jax.jit lowers through JAX's own Python code (mlir.lower_fun): random_gamma
    (jax._src.random.core._gamma_impl with use_vmap=True: Marsaglia-Tsang rejection in vmapped
    while loops), bessel_i0e (Cephes' Chebyshev series), and igamma, igammac, igamma_grad_a,
    random_gamma_grad and regularized_incomplete_beta (series and continued fractions in while
    loops), from jax._src.lax.special.
  - bessel_i1e, which XLA expands itself (the CHLO op's decomposition): Cephes' single-precision
    i1ef, the one XLA follows, written here in JAX (_bessel_i1e).

zeta and polygamma (XLA's own expansions too) are refused by name.
"""
import numpy as np

SUPPORTED_SPECIAL = {
    "random_gamma": "JAX's own lowering inlined (Marsaglia-Tsang rejection per element: vmapped while loops, "
                    "each unrolled to while_trips iterations and checked)",
    "bessel_i0e": "JAX's own lowering inlined (Cephes' Chebyshev series)",
    "bessel_i1e": "XLA's expansion (Cephes' i1ef Chebyshev series) as element-wise ops",
    "igamma": "JAX's own lowering inlined (a series or continued fraction: a while loop, unrolled to while_trips "
              "iterations and checked)",
    "igammac": "as igamma", "igamma_grad_a": "as igamma", "random_gamma_grad": "as igamma",
    "regularized_incomplete_beta": "JAX's own lowering inlined (a continued fraction: a while loop, as igamma's)",
}

# Special functions that jax.jit lowers through jax._src.lax.special's Python implementations,
# wrapped in its _up_and_broadcast: primitive -> implementation.
_SPECIAL_IMPLS = {"igamma": "igamma_impl", "igammac": "igammac_impl", "igamma_grad_a": "igamma_grad_a_impl",
                  "random_gamma_grad": "random_gamma_grad_impl",
                  "regularized_incomplete_beta": "regularized_incomplete_beta_impl"}

# Cephes' i1f.c Chebyshev coefficients (those XLA's CHLO decomposition of bessel_i1e uses for f32):
# exp(-x) I1(x) / x on [0, 8] in the variable x / 2 - 2, and exp(-x) sqrt(x) I1(x) on (8, inf) in
# 32 / x - 2.
_I1E_A = (9.38153738649577178388E-9, -4.44505912879632808065E-8, 2.00329475355213526229E-7,
          -8.56872026469545474066E-7, 3.47025130813767847674E-6, -1.32731636560394358279E-5,
          4.78156510755005422638E-5, -1.61760815825896745588E-4, 5.12285956168575772895E-4,
          -1.51357245063125314899E-3, 4.15642294431288815669E-3, -1.05640848946261981558E-2,
          2.47264490306265168283E-2, -5.29459812080949914269E-2, 1.02643658689847095384E-1,
          -1.76416518357834055153E-1, 2.52587186443633654823E-1)
_I1E_B = (-3.83538038596423702205E-9, -2.63146884688951950684E-8, -2.51223623787020892529E-7,
          -3.88256480887769039346E-6, -1.10588938762623716291E-4, -9.76109749136146840777E-3,
          7.78576235018280120474E-1)


def _chebyshev(x, coefficients):
    """Clenshaw's recurrence for sum' c_i T_i(x / 2), as Cephes' chbevl (first coefficient the
    highest order) and XLA's expansion evaluate it, in x's dtype."""
    import jax.numpy as jnp

    b0 = b1 = b2 = jnp.zeros_like(x)
    for c in coefficients:
        b2, b1 = b1, b0
        b0 = x * b1 - b2 + jnp.asarray(c, x.dtype)
    return (b0 - b2) * jnp.asarray(0.5, x.dtype)


def _bessel_i1e(x):
    """exp(-|x|) I1(x), the exponentially scaled modified Bessel function of the first kind of
    order one (jax.scipy.special.i1e), as XLA expands lax.bessel_i1e for f32: sign(x) times |x|
    times the [0, 8] series for |x| <= 8, else the (8, inf) series over sqrt(|x|). A bf16 x is
    computed in f32 and rounded, as XLA upcasts it."""
    import jax.numpy as jnp

    if x.dtype != jnp.float32:
        return _bessel_i1e(x.astype(jnp.float32)).astype(x.dtype)
    z = jnp.abs(x)
    small = z * _chebyshev(z * 0.5 - 2.0, _I1E_A)
    large = _chebyshev(32.0 / z - 2.0, _I1E_B) / jnp.sqrt(z)
    return jnp.sign(x) * jnp.where(z <= 8.0, small, large)


class _Special:
    """Converter's special functions (a mixin: uses its run, where and _sites)."""

    def _special_equation(self, name, p, ins, eqn):
        """The outputs of a special-function primitive computed from a Python implementation,
        traced and inlined; None for another primitive (or a JAX without that implementation)."""
        import functools

        import jax
        from jax._src.lax import special
        from jax._src.random import core as random_core

        if name not in SUPPORTED_SPECIAL:
            return None
        if name == "random_gamma":
            impl = functools.partial(random_core._gamma_impl, log_space=p["log_space"], use_vmap=True)
        elif name == "bessel_i0e":
            impl = getattr(special, "bessel_i0e_impl", None)
        elif name == "bessel_i1e":
            impl = _bessel_i1e
        else:
            doit = getattr(special, _SPECIAL_IMPLS[name], None)
            up = getattr(special, "_up_and_broadcast", None)
            impl = up(doit) if doit is not None and up is not None else None
        if impl is None:
            return None
        closed = jax.make_jaxpr(impl)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars])
        self._sites.append(self.where(eqn))
        try:
            return self.run(closed.jaxpr, list(closed.consts), list(ins))
        finally:
            self._sites.pop()
