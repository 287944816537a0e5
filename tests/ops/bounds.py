"""Rounding-error bounds of float computations, derived from what they compute, for tests that compare the
device with the CPU on any machine.

Each rounding of a result r costs at most u |r|, u the dtype's unit roundoff (``U``). A sum of k terms in
*any* order (sequential, pairwise, vector lanes, threads: what differs between the device, one CPU and
another) is off by at most gamma(k - 1) times the sum of the terms' absolute values, and n roundings in a
chain of products by gamma(n) relative, gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., lemma 3.1 and sec. 4.2). A result computed in a wider type and rounded once
to a 2-byte dtype is bounded by the same gamma of the 2-byte u, one rounding more.

The tests compare each side (device and CPU) with the float64 result of the same inputs within its bound,
the terms' magnitudes computed in float64 as well: so the two are within twice the bound of each other
whatever the CPU's summation order, and an error of a misplaced term, a wrong divisor or a lost bit still
stands out by orders of magnitude.
"""
import torch
import torch.nn.functional as F

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
REDUCED = (torch.bfloat16, torch.float16)


def gamma(n, dtype=torch.float32):
    """gamma(n) = n u / (1 - n u): the relative error of n roundings of ``dtype`` (n a number or a tensor)."""
    nu = n * U[dtype]
    assert bool((torch.as_tensor(nu) < 0.5).all()), "bound past its validity (n u >= 1/2)"
    return nu / (1 - nu)


def assert_within(name: str, got: torch.Tensor, exact: torch.Tensor, bound) -> None:
    """``got`` within ``bound`` (a tensor or number) of ``exact`` (float64) element by element; where the exact
    result is not finite (a NaN or infinity among the terms), ``got`` has the same non-finite value."""
    got = got.detach().cpu()
    assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    a, x = got.double(), exact.detach().double()
    finite = x.isfinite()
    assert torch.equal(a[~finite].nan_to_num(0.5), x[~finite].nan_to_num(0.5)), f"{name}: non-finite values differ"
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(x)
    err = (a - x).abs()
    bad = finite & ~(err <= bound)
    if bad.any():
        ratio = (err / bound)[bad]
        raise AssertionError(f"{name}: {int(bad.sum())} of {x.numel()} elements outside the bound; worst error "
                             f"{float(err[bad].max()):.3e} ({float(ratio.max()):.3g}x its bound), e.g. got "
                             f"{float(a[bad][0]):.8g} for {float(x[bad][0]):.8g} (bound {float(bound[bad][0]):.3e})")


def run_both(fn, x: torch.Tensor, g: torch.Tensor | None = None):
    """fn of x on the CPU and on neuron, each backward with g (drawn when not given): ((out, grad) of the CPU,
    (out, grad) of the device, g)."""
    cpu = x.clone().requires_grad_()
    dev = x.to("neuron").requires_grad_()
    want, got = fn(cpu), fn(dev)
    assert got.dtype == want.dtype and got.shape == want.shape
    if g is None:
        g = torch.randn(want.shape).to(want.dtype)
    want.backward(g)
    got.backward(g.to("neuron"))
    return (want.detach(), cpu.grad), (got.detach().cpu(), dev.grad.cpu()), g


def _jacobian(fn, x64: torch.Tensor) -> torch.Tensor:
    """fn's float64 Jacobian at x64, as a (fn(x).numel(), x.numel()) matrix."""
    out = fn(x64)
    if out.numel() == 0 or x64.numel() == 0:
        return torch.zeros(out.numel(), x64.numel(), dtype=torch.float64)
    try:
        jac = torch.func.jacfwd(fn)(x64)
    except Exception:  # noqa: BLE001 (an op without a forward-mode rule: reverse mode)
        jac = torch.autograd.functional.jacobian(fn, x64, vectorize=True)
    return jac.reshape(out.numel(), x64.numel())


def _dilated(support: torch.Tensor, shape) -> torch.Tensor:
    """Each row of a (outputs x inputs) 0/1 matrix with its inputs' neighbours (+-1 along each spatial dim of
    ``shape``, an (N, C, *spatial) input) set too."""
    d = len(shape) - 2
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[d - 1]
    rows = support.reshape(support.shape[0] * shape[0], shape[1], *shape[2:])
    return pool(rows, 3, 1, 1).reshape(support.shape)


def weight_error(size: int, kind: str) -> float:
    """The absolute error of one interpolation weight computed from a source coordinate, for inputs of at most
    ``size`` along a dim; coordinates and weights are fp32 (or wider) for every float dtype, on the CPU (its
    kernels' opmath type) and on the device. A resize's coordinate (dst + 1/2) * scale - 1/2 or dst * scale
    (the scale itself rounded) is at most 4 roundings of values up to size + 1: 4 u (size + 1); a grid's
    ("grid-" kinds), ((g + 1) size - 1) / 2 then reflected or clipped, at most 8 of values up to 2 (size + 1):
    16 u (size + 1). A linear weight (the fractional part and one minus it) moves with the coordinate plus one
    rounding; a cubic convolution weight (A = -0.75) has a slope of at most 1.35 and its Horner evaluation
    rounds 6 times values of at most 4.5 (27 u)."""
    u = U[torch.float32]
    grid = kind.startswith("grid-")
    dsrc = (16 if grid else 4) * u * (size + 1)
    return {"linear": dsrc + u, "cubic": 1.35 * dsrc + 27 * u}[kind.removeprefix("grid-")]


def linear_bounds(fn, x: torch.Tensor, g: torch.Tensor, dtype, roundings: int = 0, weights: str | None = None):
    """Per-side bounds of fn (linear in x: pooling, fold/unfold, padding, interpolation) and of its input gradient
    for the output gradient g, and their float64 values.

    Output element i is a sum of k_i terms A_ij x_j (k_i the non-zero entries of row i of fn's Jacobian A), the
    gradient element j one of A_ij g_i over column j: k - 1 additions and ``roundings`` more per term (a window's
    divisor taken as a reciprocal and multiplied in: 2; interpolation: the products of the dims' weights and the
    term) relative to T = |A| |x| (|A|^T |g|), the sums of absolute terms. A 2-byte result may also have been
    summed in its own dtype (the CPU's backward kernels often do): the bound is for every step rounded to the
    dtype. ``weights`` ("linear"/"cubic"), for interpolations: A's entries are computed, each off by
    ``weight_error``, adding that times the sum of |x| over the taps (and their neighbours: a coordinate rounded
    across an integer shifts the taps by one)."""
    x64, g64 = x.detach().double(), g.detach().double()
    jac = _jacobian(fn, x64.nan_to_num(0.0, 0.0, 0.0))      # (a linear op's Jacobian does not depend on x)
    nz = (jac != 0).double()
    steps_out = (nz.sum(1) - 1).clamp(min=0) + roundings + (dtype in REDUCED)
    steps_in = (nz.sum(0) - 1).clamp(min=0) + roundings + (dtype in REDUCED)
    xr = x64.clone().requires_grad_()
    exact = fn(xr)
    exact.backward(g64)
    if not (x64.isfinite().all() and g64.isfinite().all()):
        # non-finite terms (a linear op's Jacobian has non-negative weights here, pooling): T from fn of |x|, as
        # |A| |x| would spread them over every output (0 * inf)
        assert (jac >= 0).all()
        xa = x64.abs().requires_grad_()
        t_out = fn(xa)
        t_out.backward(g64.abs())
        t_out, t_in = t_out.detach().reshape(-1), xa.grad.reshape(-1)
    else:
        t_out, t_in = jac.abs() @ x64.abs().reshape(-1), jac.abs().t() @ g64.abs().reshape(-1)
    b_out, b_in = gamma(steps_out, dtype) * t_out, gamma(steps_in, dtype) * t_in
    if weights is not None:
        dw = weight_error(max(x.shape[2:]), weights) * (x.dim() - 2)   # each dim's weight in the product
        near = _dilated(nz, x.shape)
        b_out = b_out + dw * (near @ x64.abs().reshape(-1))
        b_in = b_in + dw * (near.t() @ g64.abs().reshape(-1))
    return (exact.detach(), xr.grad), (b_out.reshape(exact.shape), b_in.reshape(x.shape))


def _rounded_once(fn, x, g, roundings, weights):
    """``linear_bounds`` of a 2-byte x's fn computed in fp32 and rounded once to x's dtype (the device's
    pooling and interpolation kernels): the fp32 bounds and one rounding of the result."""
    (exact, exact_grad), (b_out, b_in) = linear_bounds(fn, x, g, torch.float32, roundings, weights)
    u = U[x.dtype]
    return (exact, exact_grad), (b_out + u * (exact.abs() + b_out), b_in + u * (exact_grad.abs() + b_in))


def check_linear(fn, x: torch.Tensor, roundings: int = 0, weights: str | None = None, g: torch.Tensor | None = None,
                 device_rounds_once: bool = False):
    """fn (linear in x) on the CPU and on neuron: outputs and input gradients each within ``linear_bounds`` of
    the float64 result; so within twice that of each other. ``device_rounds_once``: the device's 2-byte results
    are held to the bound of fp32 computation rounded once (``_rounded_once``)."""
    (want, want_grad), (got, got_grad), g = run_both(fn, x, g)
    (exact, exact_grad), (b_out, b_in) = linear_bounds(fn, x, g, x.dtype, roundings, weights)
    dev_out, dev_in = _rounded_once(fn, x, g, roundings, weights)[1] if device_rounds_once else (b_out, b_in)
    for side, out, grad, bo, bi in (("device", got, got_grad, dev_out, dev_in), ("cpu", want, want_grad, b_out, b_in)):
        assert_within(f"{side} output", out, exact, bo)
        assert_within(f"{side} input gradient", grad, exact_grad, bi)


# ---- normalization --------------------------------------------------------------------------------------

def norm_bounds(x, g, w, b, dims, eps: float, training: bool = True, running=None, dtype=torch.float32,
                param_dims=(1,)):
    """Per-side bounds of y = (x - mean) * rstd * w + b (statistics over ``dims`` of x, from the batch or, when
    not training, the ``running`` (mean, var)) and of its gradients for the output gradient g, all tensors
    float64 of x's shape (w, b broadcast; the parameter gradients' bounds summed over every dim but
    ``param_dims``, flattened).

    With n the statistics' count: the mean is a sum of n terms and a division, off by e_mu = gamma(n + 1)
    mean|x|. The variance (two-pass, Welford or a sum of squares less the squared mean: Chan, Golub and LeVeque,
    Algorithms for computing the sample variance, 1983) is off by at most 2 gamma(n + 2) kappa relative, kappa =
    1 + mean^2 / var its condition number; rstd = (var + eps)^-1/2 adds three roundings and halves var's
    relative error: d_r. The output, as (x - mean) rstd w + b or as x * (rstd w) + (b - mean rstd w), has each of
    mean and x carry rstd |w| (d_r + gamma(4)) relative, plus e_mu rstd |w|, and b and the result a rounding.
    The input gradient rstd w (g - mean(g) - xhat mean(g xhat)) has the means' sums (gamma(n + 2) of their
    absolute terms), xhat's error e_xh and rstd's relative error in each term; the parameters' gradients sum g
    xhat and g over every dim but the channel's (m terms). A 2-byte ``dtype`` rounds the result once more."""
    x, g = x.double(), g.double()
    n = 1
    for d in dims:
        n *= x.shape[d]
    mean, var = (x.mean(dims, keepdim=True), x.var(dims, correction=0, keepdim=True)) if training else running
    rstd = (var + eps).rsqrt()
    if training:
        e_mu = gamma(n + 1) * x.abs().mean(dims, keepdim=True)
        d_r = gamma(n + 2) * (1 + mean**2 / var) * var / (var + eps) + gamma(3)
    else:
        e_mu, d_r = torch.zeros_like(mean), gamma(3)
    w = torch.ones(()) if w is None else w.double()
    b = torch.zeros(()) if b is None else b.double()
    xhat = (x - mean) * rstd
    y = xhat * w + b
    b_y = w.abs() * rstd * (e_mu + (d_r + gamma(4)) * (x.abs() + mean.abs())) + gamma(2) * (b.abs() + y.abs())
    e_xh = rstd * e_mu + (d_r + gamma(3)) * (x.abs() + mean.abs()) * rstd
    if training:
        g1, g2 = g.abs().mean(dims, keepdim=True), (g.abs() * xhat.abs()).mean(dims, keepdim=True)
        b_dx = w.abs() * rstd * ((d_r + gamma(4)) * (g.abs() + g1 + xhat.abs() * g2) + gamma(n + 2) * g1
                                 + xhat.abs() * (gamma(n + 2) * g2 + (g.abs() * e_xh).mean(dims, keepdim=True))
                                 + e_xh * g2)
    else:
        b_dx = (d_r + gamma(2)) * (w * rstd * g).abs()        # g w rstd: rstd's error and two products
    other = [d for d in range(x.dim()) if d not in param_dims]
    m = 1
    for d in other:
        m *= x.shape[d]
    b_dw = ((g.abs() * e_xh).sum(other) + gamma(m + 1) * (g.abs() * xhat.abs()).sum(other)).reshape(-1)
    b_db = (gamma(m) * g.abs().sum(other)).reshape(-1)
    if dtype in REDUCED:
        b_y = b_y + gamma(1, dtype) * (y.abs() + b_y)
    return b_y, b_dx, b_dw, b_db


def var_bounds(x, dims, correction: int):
    """Per-side bounds of torch.var_mean's fp32 results (var, mean) over ``dims`` (all when None): the mean's sum
    of n terms and division (gamma(n + 1) mean|x|), the variance's 2 gamma(n + 2) kappa relative (see
    ``norm_bounds``) and the division by n - correction."""
    x = x.double()
    dims = tuple(range(x.dim())) if dims is None else dims
    dims = (dims,) if isinstance(dims, int) else dims
    n = 1
    for d in dims:
        n *= x.shape[d]
    var, mean = torch.var_mean(x, dims, correction=correction, keepdim=True)
    biased = x.var(dims, correction=0, keepdim=True)
    b_var = (2 * gamma(n + 2) * (1 + mean**2 / biased) + gamma(1)) * var
    b_mean = gamma(n + 1) * x.abs().mean(dims, keepdim=True)
    return b_var, b_mean


def check_linear_forward(fn, x: torch.Tensor, roundings: int = 0, weights: str | None = None,
                         device_rounds_once: bool = False):
    """``check_linear`` of the output alone (an op whose backward is tested elsewhere or not on the device)."""
    want, got = fn(x), fn(x.to("neuron")).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    g = torch.zeros(want.shape)
    (exact, _), (bound, _) = linear_bounds(fn, x, g, x.dtype, roundings, weights)
    dev_bound = _rounded_once(fn, x, g, roundings, weights)[1][0] if device_rounds_once else bound
    assert_within("device output", got, exact, dev_bound)
    assert_within("cpu output", want, exact, bound)


# ---- attention ------------------------------------------------------------------------------------------

def attention_bounds(q, k, v, g, scale=None, causal=False, attn_mask=None, enable_gqa=False, blocks_in_dtype=True):
    """Float64 (out, dq, dk, dv) of scaled_dot_product_attention of q, k, v with output gradient g, and per-side
    bounds of each for q's dtype (scores, softmax statistics and sums in fp32; a 2-byte dtype's probabilities
    or exponentials, dS and results rounded to it).

    With E the head width, S the keys, L the queries, u fp32's unit roundoff and r the 2-byte dtype's (0 for
    fp32): a score is a sum of E products, scaled: off by gamma(E + 3) of its absolute terms, which with the row
    maximum and the subtraction put exp's argument off by delta (per query row). A probability exp(s - m) / l is
    then off by eps_P = 2 delta + gamma(S + 4 + 2 B) relative (its exp, the sum l of S of them, the division; B
    rescalings of an online softmax over blocks of 128 keys). The output's S products with V add gamma(S + 1),
    r for rounded probabilities and r for the result: relative to T = P |V|. Backward: dV = P^T dO likewise
    over L; dS = P (dO V^T - D), D = rowsum(dO O), carries eps_P, the E-term sums of dO V^T and D's error in
    each term (relative to P (|dO| |V|^T + |D|)); dQ and dK sum S (L) of dS's terms with K (Q). The CPU's
    2-byte flash backward adds each block of 32 queries' (keys') contribution to dK and dV (dQ) in the dtype:
    one rounding r per block, relative to the sum of absolute terms (``blocks_in_dtype``; else one)."""
    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], -3) for t in (k, v))
    dtype = q.dtype
    red = U[dtype] if dtype in REDUCED else 0.0
    q, k, v, g = (t.detach().double() for t in (q, k, v, g))
    L, E, S = q.shape[-2], q.shape[-1], k.shape[-2]
    scale = E ** -0.5 if scale is None else scale
    bias = torch.zeros(L, S, dtype=torch.float64)
    if causal:
        bias = bias.masked_fill(torch.ones(L, S, dtype=torch.bool).tril().logical_not(), float("-inf"))
    if attn_mask is not None:
        bias = bias + (attn_mask.double() if attn_mask.is_floating_point()
                       else torch.zeros(attn_mask.shape, dtype=torch.float64).masked_fill(~attn_mask, float("-inf")))
    qk_abs = scale * q.abs() @ k.abs().transpose(-1, -2)
    delta = gamma(E + 3) * (2 * qk_abs + bias.nan_to_num(0, 0, 0).abs()).amax(-1, keepdim=True)
    p = torch.softmax(scale * q @ k.transpose(-1, -2) + bias, -1)
    eps_p = 2 * delta + gamma(S + 4 + 2 * -(-S // 128))
    o = p @ v
    b_o = (eps_p + gamma(S + 1) + 2 * red) * (p @ v.abs())
    q_blocks, k_blocks = (-(-L // 32), -(-S // 32)) if blocks_in_dtype else (1, 1)
    b_dv = (eps_p.transpose(-1, -2).amax(-1, keepdim=True) + gamma(L + 1) + (1 + q_blocks) * red) * (
        p.transpose(-1, -2) @ g.abs())
    a = g.abs() @ v.abs().transpose(-1, -2)
    d = (g * o).sum(-1, keepdim=True)
    d_abs = (g.abs() * o.abs()).sum(-1, keepdim=True)
    d_err = gamma(E + 1) * d_abs + (g.abs() * b_o).sum(-1, keepdim=True)
    ds = p * (g @ v.transpose(-1, -2) - d)
    ds_abs = p * (a + d_abs)
    ds_err = p * ((eps_p + gamma(v.shape[-1] + 2) + 2 * red) * (a + d_abs) + d_err)
    dq, dk = scale * ds @ k, scale * ds.transpose(-1, -2) @ q
    b_dq = scale * (ds_err @ k.abs() + (gamma(S + 2) + k_blocks * red) * (ds_abs @ k.abs()))
    b_dk = scale * (ds_err.transpose(-1, -2) @ q.abs()
                    + (gamma(L + 2) + q_blocks * red) * (ds_abs.transpose(-1, -2) @ q.abs()))
    dv = p.transpose(-1, -2) @ g
    return (o, dq, dk, dv), (b_o, b_dq, b_dk, b_dv)
