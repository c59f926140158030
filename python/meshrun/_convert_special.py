"""Special functions in meshrun._convert, computed as jax.jit computes them: each is traced from a
Python implementation into the program's own ops (element-wise ops, SELECTs, and while loops
unrolled to ``while_trips`` iterations and checked), so its results are jax.jit's to f32 rounding.

  - Those jax.jit lowers through JAX's own Python code (mlir.lower_fun): random_gamma
    (jax._src.random.core._gamma_impl with use_vmap=True: Marsaglia-Tsang rejection in vmapped
    while loops), bessel_i0e (Cephes' Chebyshev series), and igamma, igammac, igamma_grad_a,
    random_gamma_grad and regularized_incomplete_beta (series and continued fractions in while
    loops), from jax._src.lax.special.
  - bessel_i1e, zeta and polygamma, which XLA expands itself (the CHLO ops' decompositions),
    written here in JAX step for step as that expansion: Cephes' single-precision i1ef series
    (_bessel_i1e); the Hurwitz zeta by 10 terms and a 12-term Euler-Maclaurin tail, with XLA's
    poles and domain errors (_zeta); polygamma from zeta, lgamma and digamma (_polygamma), which is
    also digamma's derivative.
"""
import numpy as np

SUPPORTED_SPECIAL = {
    "random_gamma": "JAX's own lowering inlined (Marsaglia-Tsang rejection per element: vmapped while loops, "
                    "each unrolled to while_trips iterations and checked)",
    "bessel_i0e": "JAX's own lowering inlined (Cephes' Chebyshev series)",
    "bessel_i1e": "XLA's expansion (Cephes' i1ef Chebyshev series) as element-wise ops",
    "zeta": "XLA's expansion (10 terms and a 12-term Euler-Maclaurin tail) as element-wise ops",
    "polygamma": "XLA's expansion ((-1)^(n+1) n! zeta(n + 1, x); digamma for n = 0) as element-wise ops",
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


def _upcast(fn, *args):
    """fn computed in f32 for bf16 operands and rounded back, as XLA's expansions upcast them; None
    where the operands are f32 already."""
    import jax.numpy as jnp

    if args[0].dtype == jnp.float32:
        return None
    return fn(*[a.astype(jnp.float32) for a in args]).astype(args[0].dtype)


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

    up = _upcast(_bessel_i1e, x)
    if up is not None:
        return up
    z = jnp.abs(x)
    small = z * _chebyshev(z * 0.5 - 2.0, _I1E_A)
    large = _chebyshev(32.0 / z - 2.0, _I1E_B) / jnp.sqrt(z)
    return jnp.sign(x) * jnp.where(z <= 8.0, small, large)


# (2k)! / B_2k, the Euler-Maclaurin coefficients of XLA's zeta expansion, last term first.
_ZETA_COEFFS = (-7.1661652561756670113e18, 1.8152105401943546773e17, -4.5979787224074726105e15,
                1.1646782814350067249e14, -2.950130727918164224e12, 7.47242496e10,
                -1.8924375803183791606e9, 47900160.0, -1209600.0, 30240.0, -720.0, 12.0)


def _zeta(x, q):
    """The Hurwitz zeta function sum_k (k + q)^-x (jax.scipy.special.zeta), as XLA expands
    lax.zeta: the first 10 terms, then the Euler-Maclaurin tail (Horner's rule over 12
    coefficients) unless it is negligible; NaN for x < 1 or a non-integer x at q <= 0; at an
    integer q <= 0 (a pole) inf for an even integer x, else NaN; inf at x = 1."""
    import jax.numpy as jnp
    from jax import lax

    up = _upcast(_zeta, x, q)
    if up is not None:
        return up
    c = lambda v: jnp.asarray(v, x.dtype)  # noqa: E731
    neg_x = -x
    initial_sum = lax.pow(q, neg_x)
    a = q
    for _ in range(9):
        a = a + c(1.0)
        initial_sum = initial_sum + lax.pow(a, neg_x)
    a = a + c(1.0)
    neg_power = lax.pow(a, neg_x)
    s = initial_sum + neg_power * a / (x - c(1.0))
    a_inverse_square = c(1.0) / (a * a)
    horner = jnp.zeros_like(x)
    for i in range(11):
        factor = (x - c(22 - 2 * i)) * (x - c(21 - 2 * i))
        horner = factor * (a_inverse_square * (horner + c(1.0 / _ZETA_COEFFS[i])))
    s = s + neg_power * (c(0.5) + x / a * (c(1.0 / _ZETA_COEFFS[11]) + horner))
    tiny = c(np.finfo(np.float32).smallest_subnormal)
    out = jnp.where(jnp.abs(neg_power) < jnp.abs(initial_sum) * tiny, initial_sum, s)
    nan, inf = c(np.nan), c(np.inf)
    out = jnp.where(x < c(1.0), nan, out)
    q_le_zero = q <= c(0.0)
    x_is_int = x == jnp.floor(x)
    out = jnp.where(q_le_zero & ~x_is_int, nan, out)
    at_pole = q_le_zero & (q == jnp.floor(q))
    x_is_even_int = x_is_int & (lax.rem(x, c(2.0)) == c(0.0))
    out = jnp.where(at_pole, jnp.where(x_is_even_int, inf, nan), out)
    return jnp.where(x == c(1.0), inf, out)


def _polygamma(n, x):
    """The n-th derivative of digamma (jax.scipy.special.polygamma), as XLA expands lax.polygamma:
    (2 (n mod 2) - 1) exp(lgamma(n + 1)) zeta(n + 1, x); digamma(x) for n = 0; NaN for an n that is
    not a natural number."""
    import jax.numpy as jnp
    from jax import lax

    up = _upcast(_polygamma, n, x)
    if up is not None:
        return up
    c = lambda v: jnp.asarray(v, x.dtype)  # noqa: E731
    sign = c(2.0) * lax.rem(n, c(2.0)) - c(1.0)
    n_plus_one = n + c(1.0)
    out = sign * jnp.exp(lax.lgamma(n_plus_one)) * _zeta(n_plus_one, x)
    out = jnp.where(n == c(0.0), lax.digamma(x), out)
    not_natural = (n != jnp.floor(n)) | (n < c(0.0))
    return jnp.where(not_natural, c(np.nan), out)


# Primitives XLA expands itself -> the expansion written in JAX.
_EXPANDED = {"bessel_i1e": _bessel_i1e, "zeta": _zeta, "polygamma": _polygamma}


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
        elif name in _EXPANDED:
            impl = _EXPANDED[name]
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
