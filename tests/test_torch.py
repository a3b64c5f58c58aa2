"""cupyflash.torch: the autograd function on torch tensors.

CPU tensors run the NumPy path through views of their memory, so the wrapper's views (layouts, GQA,
strided inputs), outputs, gradients and modifiers are checked here against the float64 reference
without a GPU. The GPU tests check the same on CUDA tensors against the float64 reference and torch
SDPA, at every dtype, and that the calls queue on torch's current stream without synchronising.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cupyflash  # noqa: E402
from cupyflash import reference  # noqa: E402
from cupyflash.torch import flash_attention, flash_attention_varlen  # noqa: E402
from helpers import gpu_test  # noqa: E402
from tolerances import BWD_CEILING, FWD_CEILING, ROUNDOFF_SLACK, rel_err  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}


def to_numpy(x):
    """A tensor's values as float64 NumPy."""
    return x.detach().to("cpu", torch.float64).numpy()


def bhnd(x, layout):
    """A (B, H, N, D) view of a tensor in ``layout``."""
    return x if layout == "bhnd" else x.transpose(1, 2)


def shaped(shape_bhnd, layout):
    b, h, n, d = shape_bhnd
    return shape_bhnd if layout == "bhnd" else (b, n, h, d)


def random_qkv(shape_q, shape_kv, dtype=torch.float64, device="cpu", layout="bhnd", seed=0):
    """q, k, v (requiring gradients) and do, standard normal, in ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shaped(s, layout), generator=gen, dtype=torch.float64)
                   for s in (shape_q, shape_kv, shape_kv, shape_q))
    q, k, v = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
    return q, k, v, do.to(device, dtype)


def reference_attention(q, k, v, do, layout="bhnd", **kw):
    """The float64 reference's o, lse, dq, dk, dv (GQA by repeating K/V heads, query head h reading K/V head
    h // G, and summing their gradients), in the tensors' layout. Extra results (dbias, dsink) follow."""
    qn, kn, vn, don = (to_numpy(bhnd(x, layout)) for x in (q, k, v, do))
    group = qn.shape[1] // kn.shape[1]
    kr, vr = (numpy.repeat(x, group, axis=1) for x in (kn, vn))
    o, m, l = reference.attention_forward(qn, kr, vr, **kw)
    dq, dk, dv, *rest = reference.attention_backward(don, qn, kr, vr, o, m, l, **kw)
    dk, dv = (g.reshape(kn.shape[0], kn.shape[1], group, *kn.shape[2:]).sum(2) for g in (dk, dv))
    back = (lambda x: x) if layout == "bhnd" else (lambda x: x.swapaxes(1, 2))
    with numpy.errstate(divide="ignore"):
        lse = m + numpy.log(l)
    return (back(o), lse, back(dq), back(dk), back(dv), *rest)


def ours(q, k, v, do, **kw):
    """o, lse, dq, dk, dv of cupyflash.torch."""
    o, lse = flash_attention(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return (o, lse, *grads)


def assert_matches(got, want, tol, names=("o", "lse", "dq", "dk", "dv")):
    """Relative Frobenius errors at most ``tol``; absolute where the reference's norm is below 1 (a
    gradient that vanishes in exact arithmetic, with one visible key per row, is rounding noise)."""
    for name, g, w in zip(names, got, want):
        g = to_numpy(g) if isinstance(g, torch.Tensor) else g
        assert g.shape == w.shape, (name, g.shape, w.shape)
        err = rel_err(g, w) * min(1.0, numpy.linalg.norm(w[numpy.isfinite(w)]))
        assert err <= tol, f"{name}: error {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------
# The module

def test_import_cupyflash_imports_no_torch_and_the_module_reads_the_real_torch():
    code = ("import sys, cupyflash; assert 'torch' not in sys.modules, 'cupyflash imported torch'; "
            "import cupyflash.torch as t; import torch; assert t.torch is torch and hasattr(torch, 'autograd'); "
            "assert sys.modules['torch'].__name__ == 'torch'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


# ---------------------------------------------------------------------------
# CPU tensors: the NumPy path through views, against the float64 reference

FLOAT64_TOL = 1e-10


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_gradients_match_the_reference(layout, kv_heads, causal):
    q, k, v, do = random_qkv((2, 4, 37, 16), (2, kv_heads, 53, 16), layout=layout)
    got = ours(q, k, v, do, causal=causal, layout=layout)
    assert got[0].shape == q.shape and got[1].shape == (2, 4, 37)
    assert all(g.shape == x.shape for g, x in zip(got[2:], (q, k, v)))
    assert_matches(got, reference_attention(q, k, v, do, layout, causal=causal), FLOAT64_TOL)


@settings(deadline=None, max_examples=25)
@given(layout=st.sampled_from(["bhnd", "bnhd"]), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2]),
       n_q=st.sampled_from([1, 17, 64]), n_k=st.sampled_from([1, 17, 70]), head_dim=st.sampled_from([8, 40]),
       causal=st.booleans(), window=st.sampled_from([None, (8, 0), (None, 3), (5, 5)]),
       softcap=st.sampled_from([None, 5.0]))
def test_any_layout_heads_lengths_and_masks_match_the_reference(layout, kv_heads, group, n_q, n_k, head_dim, causal,
                                                                 window, softcap):
    q, k, v, do = random_qkv((2, kv_heads * group, n_q, head_dim), (2, kv_heads, n_k, head_dim), layout=layout)
    kw = dict(causal=causal, window=window, softcap=softcap)
    assert_matches(ours(q, k, v, do, layout=layout, **kw), reference_attention(q, k, v, do, layout, **kw),
                   FLOAT64_TOL)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_dtype_runs_in_its_own_precision(dtype):
    q, k, v, do = random_qkv((2, 4, 40, 32), (2, 2, 40, 32), dtype=TORCH_DTYPES[dtype])
    got = ours(q, k, v, do, causal=True)
    assert got[0].dtype == q.dtype and got[1].dtype == torch.float32
    assert all(g.dtype == q.dtype for g in got[2:])
    # the reference sees the same rounded inputs; the NumPy path computes in float32
    want = reference_attention(q, k, v, do, causal=True)
    assert_matches(got, want, {"float16": 2e-3, "bfloat16": 1.5e-2, "float32": 1e-5}[dtype])


def test_strided_inputs_are_read_in_place_and_left_unchanged():
    base_q, base_k, base_v, do = random_qkv((2, 6, 40, 32), (2, 6, 50, 32))
    # every other head, and rows sliced: views, not contiguous
    q, k, v = base_q[:, ::2, 3:33], base_k[:, 1::2], base_v[:, ::2]
    do = do[:, ::2, 3:33]
    before = [x.detach().clone() for x in (base_q, base_k, base_v)]
    assert_matches(ours(q, k, v, do, causal=True), reference_attention(q, k, v, do, causal=True), FLOAT64_TOL)
    assert all(torch.equal(b, x) for b, x in zip(before, (base_q, base_k, base_v)))


def test_bnhd_outputs_have_the_inputs_shapes_over_bhnd_memory():
    q, k, v, do = random_qkv((2, 4, 30, 16), (2, 2, 30, 16), layout="bnhd")
    o = flash_attention(q, k, v, layout="bnhd")
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert o.shape == q.shape and o.transpose(1, 2).is_contiguous()
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert dk.transpose(1, 2).is_contiguous()


def test_expanded_gradient_of_a_sum_is_read_through_zero_strides():
    q, k, v, _ = random_qkv((1, 2, 20, 8), (1, 2, 20, 8))
    o = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(o.sum(), (q, k, v))   # do is ones expanded: every stride 0
    want = reference_attention(q, k, v, torch.ones_like(o), causal=True)
    assert_matches(grads, want[2:], FLOAT64_TOL, names=("dq", "dk", "dv"))


def test_lse_is_the_rows_log_sum_exp_and_an_empty_row_is_minus_inf():
    q, k, v, _ = random_qkv((1, 2, 8, 8), (1, 2, 8, 8))
    _, lse = flash_attention(q, k, v, window=(0, 0), causal=True, return_lse=True)   # each row sees its own key
    s = (q * k).sum(-1).detach() / 8 ** 0.5
    torch.testing.assert_close(lse, s, rtol=1e-12, atol=1e-12)
    q, k, v, _ = random_qkv((1, 2, 8, 8), (1, 2, 0, 8))
    o, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.all(o == 0) and torch.all(lse == -torch.inf)


def test_no_gradient_wanted_runs_the_forward_alone():
    q, k, v, _ = random_qkv((1, 2, 16, 8), (1, 2, 16, 8))
    with torch.no_grad():
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert o.grad_fn is None and not o.requires_grad
    o2, lse2 = flash_attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    o3 = flash_attention(q, k, v, causal=True)
    assert o3.grad_fn is not None and torch.equal(o3.detach(), o)


def test_gradients_pass_torch_gradcheck():
    q, k, v, _ = random_qkv((1, 2, 5, 4), (1, 1, 6, 4))
    sink = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, sink, bias: flash_attention(q, k, v, causal=True, sink=sink,
                                                                                bias=bias), (q, k, v, sink, bias))


@pytest.mark.parametrize("layout, kv_heads, modifiers", [("bhnd", 2, False), ("bnhd", 1, True), ("bhnd", 2, True)])
def test_gradients_through_lse_pass_gradcheck(layout, kv_heads, modifiers):
    """A loss of o and lse: the widened backward, the sink's extra term, both layouts, GQA."""
    q, k, v, _ = random_qkv((2, 2, 5, 4), (2, kv_heads, 6, 4), layout=layout)
    extras = ()
    if modifiers:
        extras = (torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True),
                  torch.randn(2, 1, 5, 6, dtype=torch.float64, requires_grad=True))

    def loss(q, k, v, *extras):
        kw = dict(zip(("sink", "bias"), extras))
        o, lse = flash_attention(q, k, v, causal=True, layout=layout, return_lse=True, softcap=3.0, **kw)
        return o.square().sum() + (lse * torch.arange(lse.numel(), dtype=lse.dtype).view(lse.shape)).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v, *extras))
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, return_lse=True, layout=layout)[1].sum(),
                                    (q, k, v))   # lse alone: o unused


def test_gradients_through_lse_of_packed_sequences_pass_gradcheck():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(7, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def loss(q, k, v):
        o, lse = flash_attention_varlen(q, k, v, cu, cu, 4, 4, causal=True, return_lse=True)
        return o.sum() + lse.cos().sum()

    assert torch.autograd.gradcheck(loss, (q, k, v))


def test_gradients_through_lse_with_dropout_raise():
    q, k, v, _ = random_qkv((1, 2, 5, 4), (1, 2, 5, 4))
    o, lse = flash_attention(q, k, v, dropout_p=0.1, seed=1, return_lse=True)
    torch.autograd.grad(o.sum(), (q,), retain_graph=True)   # o alone: fine
    with pytest.raises(NotImplementedError, match="dropout"):
        torch.autograd.grad(lse.sum(), (q,))


def test_double_backward_raises_instead_of_a_wrong_answer():
    q, k, v, do = random_qkv((1, 2, 5, 4), (1, 2, 5, 4))
    dq, = torch.autograd.grad(flash_attention(q, k, v), (q,), do.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_modifiers_and_their_gradients_match_the_reference(kv_heads):
    q, k, v, do = random_qkv((2, 4, 24, 16), (2, kv_heads, 30, 16))
    gen = torch.Generator().manual_seed(1)
    slopes = torch.rand(4, generator=gen, dtype=torch.float64)
    sink = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    bias = torch.randn(2, 1, 24, 30, generator=gen, dtype=torch.float64).requires_grad_()   # broadcast over heads
    mask = torch.rand(24, 30, generator=gen) > 0.2
    o = flash_attention(q, k, v, causal=True, alibi_slopes=slopes, sink=sink, bias=bias, mask=mask, softcap=4.0)
    got = torch.autograd.grad(o, (q, k, v, bias, sink), do)
    group = 4 // kv_heads
    kw = dict(causal=True, alibi_slopes=slopes.numpy(), sink=sink.detach().numpy(), softcap=4.0,
              bias=numpy.broadcast_to(to_numpy(bias), (2, 4, 24, 30)), mask=mask.numpy(), bias_grad=True)
    qn, kn, vn, don = (to_numpy(x) for x in (q, k, v, do))
    kr, vr = (numpy.repeat(x, group, axis=1) for x in (kn, vn))
    fwd_kw = {n: x for n, x in kw.items() if n != "bias_grad"}
    o_ref, m, l = reference.attention_forward(qn, kr, vr, **fwd_kw)
    dq, dk, dv, dbias, dsink = reference.attention_backward(don, qn, kr, vr, o_ref, m, l, **kw)
    dk, dv = (g.reshape(2, kv_heads, group, 30, 16).sum(2) for g in (dk, dv))
    assert_matches((o, *got), (o_ref, dq, dk, dv, dbias.sum(1, keepdims=True), dsink), FLOAT64_TOL,
                   names=("o", "dq", "dk", "dv", "dbias", "dsink"))


@pytest.mark.parametrize("layout, kv_heads", [("bhnd", 4), ("bnhd", 2)])
def test_a_block_mask_gives_what_its_mask_mod_gives(layout, kv_heads):
    """``block_mask=`` passes to both passes: the values and gradients of its mask_mod given as keywords, for
    the kernels' batch shape ((B, H), or (B, H_kv, H / H_kv) under GQA); another batch shape is refused."""
    import cupyflash

    q, k, v, do = random_qkv((2, 4, 24, 16), (2, kv_heads, 30, 16), layout=layout)
    doc = numpy.repeat([0, 1, 2], [10, 9, 11]).astype(numpy.int32)
    mask_mod, mod_args = "doc[q_idx + 6] == doc[kv_idx] && kv_idx <= q_idx + 6", {"doc": doc}
    batch = (2, 4) if kv_heads == 4 else (2, kv_heads, 4 // kv_heads)
    bm = cupyflash.block_mask(mask_mod, batch, 24, 30, mod_args=mod_args)
    o = flash_attention(q, k, v, block_mask=bm, layout=layout)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    o = flash_attention(q, k, v, mask_mod=mask_mod, mod_args=mod_args, layout=layout)
    want = (o, *torch.autograd.grad(o, (q, k, v), do))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert not torch.equal(got[0], flash_attention(q, k, v, layout=layout))   # the mask hides pairs
    if kv_heads != 4:
        wrong = cupyflash.block_mask(mask_mod, (2, 4), 24, 30, mod_args=mod_args)
        with pytest.raises(ValueError, match="block_mask serves batch_shape"):
            flash_attention(q, k, v, block_mask=wrong, layout=layout)


def test_dropout_repeats_under_one_seed_and_matches_the_reference():
    q, k, v, do = random_qkv((1, 2, 20, 8), (1, 2, 20, 8))
    got = ours(q, k, v, do, dropout_p=0.3, seed=7)
    again = ours(q, k, v, do, dropout_p=0.3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert_matches(got, reference_attention(q, k, v, do, dropout_p=0.3, seed=7), FLOAT64_TOL)
    torch.manual_seed(3)
    drawn = flash_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(drawn, flash_attention(q, k, v, dropout_p=0.3))   # the seed comes from torch's generator


def test_a_seed_tensor_drops_what_its_int_drops():
    """A seed given as a tensor (one int64, or two int32 words, the low one first) is the seed it holds:
    o and the gradients equal the int seed's; a tensor of another kind is refused naming the seed."""
    q, k, v, do = random_qkv((1, 2, 20, 8), (1, 2, 24, 8))
    seed = 0x12345678_9ABCDEF
    want = ours(q, k, v, do, dropout_p=0.3, seed=seed, causal=True)
    for held in (torch.tensor([seed], dtype=torch.int64),
                 torch.tensor([seed & 0xFFFFFFFF, seed >> 32], dtype=torch.int64).to(torch.int32)):
        got = ours(q, k, v, do, dropout_p=0.3, seed=held, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="seed tensor holds one int64 or two int32"):
        flash_attention(q, k, v, dropout_p=0.3, seed=torch.zeros(3, dtype=torch.int32))


# four packed sequences, one with no query rows, against more keys each
PACKED_Q, PACKED_K = [5, 0, 17, 9], [7, 3, 17, 12]


def packed_inputs(kv_heads, seed):
    """q (total_q, 4, 16), k, v (total_k, kv_heads, 16) requiring gradients, do, and the int32 offsets."""
    cu_q, cu_k = (numpy.cumsum([0] + n).astype(numpy.int32) for n in (PACKED_Q, PACKED_K))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(PACKED_Q), 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(PACKED_K), kv_heads, 16, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    return q, k, v, do, cu_q, cu_k


def packed_reference(q, k, v, do, cu_q, cu_k, backward_kw=None, **kw):
    """The float64 reference's varlen o, m, l and gradients (dq, dk, dv, and dbias where asked) in the
    tensors' (total, H, D) layout, K/V heads repeated for GQA and their gradients summed back."""
    group = q.shape[1] // k.shape[1]
    qn, don = (to_numpy(x).swapaxes(0, 1) for x in (q, do))          # (H, total, D)
    kn, vn = (numpy.repeat(to_numpy(x).swapaxes(0, 1), group, axis=0) for x in (k, v))
    o, m, l = reference.attention_varlen_forward(qn, kn, vn, cu_q, cu_k, **kw)
    dq, dk, dv, *rest = reference.attention_varlen_backward(don, qn, kn, vn, o, m, l, cu_q, cu_k,
                                                            **(backward_kw or {}), **kw)
    dk, dv = (g.reshape(k.shape[1], group, *g.shape[1:]).sum(1).swapaxes(0, 1) for g in (dk, dv))
    return o.swapaxes(0, 1), m, l, dq.swapaxes(0, 1), dk, dv, *rest


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_packed_sequences_match_the_reference(kv_heads):
    q, k, v, do, cu_q, cu_k = packed_inputs(kv_heads, 5)
    o, lse = flash_attention_varlen(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 17, 17, causal=True,
                                    return_lse=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert o.shape == q.shape and lse.shape == (4, sum(PACKED_Q))
    o_ref, m, l, *grads_ref = packed_reference(q, k, v, do, cu_q, cu_k, causal=True)
    with numpy.errstate(divide="ignore"):
        lse_ref = m + numpy.log(l)
    assert_matches((o, lse, *grads), (o_ref, lse_ref, *grads_ref), FLOAT64_TOL)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_sequences_take_expressions_per_sequence(kv_heads):
    """score_mod (with its derivative) and mask_mod on packed sequences, positions per sequence: values and
    gradients of the float64 reference's varlen call with the same expressions."""
    q, k, v, do, cu_q, cu_k = packed_inputs(kv_heads, 8)
    kw = dict(score_mod="c * tanhf(s / c)", mask_mod="kv_idx <= q_idx + n && kv_idx % 4 != 1",
              mod_args={"c": 3.0, "n": 2})
    grad = "1 - tanhf(s / c) * tanhf(s / c)"
    o = flash_attention_varlen(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 17, 17,
                               score_mod_grad=grad, **kw)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref, _, _, *grads_ref = packed_reference(q, k, v, do, cu_q, cu_k, {"score_mod_grad": grad}, **kw)
    assert_matches((o, *grads), (o_ref, *grads_ref), FLOAT64_TOL)
    plain = flash_attention_varlen(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 17, 17)
    assert not torch.allclose(o, plain)   # the expressions change the attention


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_sequences_take_a_bias_with_its_gradient_and_a_mask(kv_heads):
    """A bias (H, total_q, total_k) that requires grad and a boolean mask over the packed pairs: each sequence
    reads its own block; values, gradients and dbias (zero between sequences) as the float64 reference's."""
    q, k, v, do, cu_q, cu_k = packed_inputs(kv_heads, 9)
    gen = torch.Generator().manual_seed(10)
    bias = torch.randn(4, sum(PACKED_Q), sum(PACKED_K), generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(sum(PACKED_Q), sum(PACKED_K), generator=gen) > 0.25
    o = flash_attention_varlen(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 17, 17, causal=True,
                               bias=bias, mask=mask)
    grads = torch.autograd.grad(o, (q, k, v, bias), do)
    o_ref, _, _, *grads_ref = packed_reference(q, k, v, do, cu_q, cu_k, {"bias_grad": True}, causal=True,
                                               bias=to_numpy(bias), mask=mask.numpy())
    assert_matches((o, *grads), (o_ref, *grads_ref), FLOAT64_TOL, names=("o", "dq", "dk", "dv", "dbias"))
    assert not grads[3][:, :5, 7:].any()   # pairs between sequences


@pytest.mark.parametrize("call, error, words", [
    (lambda q, k, v: flash_attention(q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: flash_attention(q, k, v, layout="nhd"), ValueError, "layout"),
    (lambda q, k, v: flash_attention(q[0], k[0], v[0]), ValueError, r"q must have shape \(B, H, N, D\)"),
    (lambda q, k, v: flash_attention(q, k.double(), v), TypeError, "share one dtype"),
    (lambda q, k, v: flash_attention(q.int(), k.int(), v.int()), TypeError, "share one dtype"),
    (lambda q, k, v: flash_attention(q, k[:, :3], v[:, :3]), ValueError, "multiple"),
    (lambda q, k, v: flash_attention(q, k, v[..., :4]), ValueError, "k and v must have one shape"),
    (lambda q, k, v: flash_attention(q, k, v, causal="yes"), TypeError, "causal"),
    (lambda q, k, v: flash_attention(q, k, v, sink=torch.zeros(3)), ValueError, "sink"),
])
def test_bad_calls_raise_naming_what_is_wrong(call, error, words):
    q, k, v = (torch.zeros(1, 4, 6, 8) for _ in range(3))
    with pytest.raises(error, match=words):
        call(q, k, v)


def kvcache_case(rng, paged: bool, dtype=numpy.float64, B=2, Hkv=2, G=3, Nq=2, D=16, N_max=40, page=8):
    """(q, k_cache, v_cache, lens, k, v, table) of a decoding call, NumPy in (B, H, N, D) order: lengths that
    leave room for Nq new keys, a paged cache's pages shuffled."""
    q = rng.standard_normal((B, Hkv * G, Nq, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, Nq, D)).astype(dtype) for _ in range(2))
    lens = numpy.array([5, N_max - Nq][:B] + [3] * (B - 2), numpy.int32)
    shape = (B * N_max // page, Hkv, page, D) if paged else (B, Hkv, N_max, D)
    k_cache, v_cache = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    table = rng.permutation(shape[0]).reshape(B, -1).astype(numpy.int32) if paged else None
    return q, k_cache, v_cache, lens, k, v, table


def as_layout(x, layout):
    """A tensor of NumPy ``x`` (given in (B, H, N, D) order) laid out in ``layout``: (B, N, H, D) memory for
    ``bnhd`` (a paged cache's pages as (page, H, D))."""
    t = torch.from_numpy(numpy.ascontiguousarray(x))
    return t if layout == "bhnd" else t.transpose(1, 2).contiguous()


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_decodes_and_appends_as_cupyflash_does(layout, paged):
    """cupyflash.torch.flash_attention_with_kvcache on CPU tensors (the NumPy path over their memory) gives
    cupyflash's own call on NumPy arrays of the same values: o, lse, and the caches after the new keys
    were written into them in place, in both layouts, GQA, a paged cache's shuffled pages; q, the new
    keys, the lengths and the table unchanged."""
    from cupyflash.torch import flash_attention_with_kvcache as torch_kvcache

    rng = numpy.random.default_rng(3)
    q, kc, vc, lens, k, v, table = kvcache_case(rng, paged)
    want_kc, want_vc = kc.copy(), vc.copy()
    want = cupyflash.flash_attention_with_kvcache(q, want_kc, want_vc, lens, k=k, v=v, block_table=table,
                                                  causal=True, softcap=3.0)
    tq, tkc, tvc, tk, tv = (as_layout(x, layout) for x in (q, kc, vc, k, v))
    tlens, ttable = torch.from_numpy(lens.copy()), None if table is None else torch.from_numpy(table.copy())
    before = [x.clone() for x in (tq, tk, tv, tlens)]
    o, lse = torch_kvcache(tq, tkc, tvc, tlens, tk, tv, block_table=ttable, causal=True, softcap=3.0, layout=layout,
                           return_lse=True)
    assert o.shape == tq.shape and o.dtype == tq.dtype and lse.shape == (2, 6, 2)
    numpy.testing.assert_allclose(bhnd(o, layout).numpy(), want[0], rtol=1e-12, atol=1e-14)
    numpy.testing.assert_allclose(lse.numpy(), want[1] + numpy.log(want[2]), rtol=1e-12, atol=1e-14)
    for got, expected in ((tkc, want_kc), (tvc, want_vc)):
        numpy.testing.assert_array_equal(bhnd(got, layout).numpy(), expected)
    for x, y in zip((tq, tk, tv, tlens), before):
        assert torch.equal(x, y)
    if table is not None:
        numpy.testing.assert_array_equal(ttable.numpy(), table)


@pytest.mark.parametrize("change, error, words", [
    (dict(layout="nhd"), ValueError, "layout"),
    (dict(lens=torch.tensor([1, 2], dtype=torch.int64)), TypeError, "cache_seqlens must have dtype torch.int32"),
    (dict(k_cache=torch.zeros(2, 2, 40, 16, dtype=torch.float32)), TypeError, "k_cache must have dtype"),
    (dict(q=numpy.zeros((2, 6, 2, 16))), TypeError, "q must be a torch.Tensor"),
    (dict(v_cache=torch.zeros(2, 40, 16, dtype=torch.float64)), ValueError, "v_cache must have 4 dims"),
    (dict(lens=torch.tensor([50, 2], dtype=torch.int32)), ValueError, "cache_seqlens"),
])
def test_kvcache_bad_calls_raise_naming_the_argument(change, error, words):
    from cupyflash.torch import flash_attention_with_kvcache as torch_kvcache

    q, kc, vc, lens, k, v, _ = kvcache_case(numpy.random.default_rng(4), False)
    args = dict(q=torch.from_numpy(q), k_cache=torch.from_numpy(kc), v_cache=torch.from_numpy(vc),
                lens=torch.from_numpy(lens), k=torch.from_numpy(k), v=torch.from_numpy(v), layout="bhnd")
    args.update(change)
    with pytest.raises(error, match=words):
        torch_kvcache(args["q"], args["k_cache"], args["v_cache"], args["lens"], args["k"], args["v"],
                      layout=args["layout"])


# ---------------------------------------------------------------------------
# CUDA tensors: the kernels, against the float64 reference and torch SDPA

def cuda_available():
    return torch.cuda.is_available()


needs_torch_cuda = pytest.mark.skipif(not cuda_available(), reason="needs torch with CUDA")


def sdpa(q, k, v, do, causal, layout, group):
    """torch SDPA's o, dq, dk, dv in the inputs' own dtype, the peer of the same precision."""
    leaves = [bhnd(x, layout).detach().clone().requires_grad_() for x in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=group > 1)
    grads = torch.autograd.grad(o, leaves, bhnd(do, layout))
    back = (lambda x: x) if layout == "bhnd" else (lambda x: x.transpose(1, 2))
    return [back(x) for x in (o, *grads)]


@gpu_test
@needs_torch_cuda
def test_a_process_whose_first_kernels_load_in_torchs_backward_thread():
    """torch runs a backward on a thread of its own, where no CUDA context need be current: the first
    backward of a fresh process loads its kernels there (this raised CUDA_ERROR_INVALID_CONTEXT for
    float32, whose backward made no CuPy runtime call before its module loaded)."""
    code = ("import torch, cupyflash.torch as ct\n"
            "for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):\n"
            "    q, k, v = (torch.randn(2, 3, 70, 64, device='cuda', dtype=dtype, requires_grad=True) for _ in range(3))\n"
            "    ct.flash_attention(q, k, v, causal=True).sum().backward()\n"
            "    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@gpu_test
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_values_and_gradients_against_float64_and_sdpa(dtype, layout, kv_heads, causal):
    """At most twice torch SDPA's error in the same dtype (plus the accumulator's slack), and under
    the suite's ceilings unless SDPA is worse; float64 under its ceiling."""
    q, k, v, do = random_qkv((2, 8, 300, 64), (2, kv_heads, 300, 64), TORCH_DTYPES[dtype], "cuda", layout, seed=2)
    before = [x.detach().clone() for x in (q, k, v, do)]
    o, lse, *grads = ours(q, k, v, do, causal=causal, layout=layout)
    torch.cuda.synchronize()
    assert all(torch.equal(b, x) for b, x in zip(before, (q, k, v, do)))   # inputs untouched
    want = reference_attention(q, k, v, do, layout, causal=causal)
    peer = sdpa(q, k, v, do, causal, layout, 8 // kv_heads)
    assert rel_err(to_numpy(lse), want[1]) <= (1e-12 if dtype == "float64" else 1e-5)
    for name, got, ref, other, ceiling in zip(("o", "dq", "dk", "dv"), (o, *grads), (want[0], *want[2:]), peer,
                                              (FWD_CEILING, BWD_CEILING, BWD_CEILING, BWD_CEILING)):
        assert got.shape == other.shape and got.dtype == other.dtype
        err, base = rel_err(to_numpy(got), ref), rel_err(to_numpy(other), ref)
        assert err <= max(2 * base + ROUNDOFF_SLACK[dtype], ceiling[dtype]), \
            f"{name}: error {err:.2e}, SDPA's {base:.2e} ({dtype})"


@gpu_test
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_forward_equals_cupyflash_called_directly(dtype):
    """The wrapper changes nothing but the way in: the same kernels on the same values give the same bits."""
    import cupy

    import cupyflash

    q, k, v, do = random_qkv((2, 4, 200, 64), (2, 2, 200, 64), TORCH_DTYPES[dtype], "cuda")
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    as_cupy = [cupy.from_dlpack(x.detach().contiguous()) for x in (q, k, v, do)]
    cq, ck, cv, cdo = as_cupy
    if dtype == "bfloat16":   # DLPack hands bfloat16 over as CuPy's own bfloat16 (ml_dtypes')
        assert cq.dtype.name == "bfloat16"
    # the views the wrapper makes: query heads (H_kv, G), K/V heads with a broadcast axis of stride 0
    ck, cv = (cupy.lib.stride_tricks.as_strided(x, (2, 2, 1, 200, 64), (x.strides[0], x.strides[1], 0,
                                                                       *x.strides[2:])) for x in (ck, cv))
    cq5 = cq.reshape(2, 2, 2, 200, 64)
    o2, m2, l2 = cupyflash.flash_attention_forward(cq5, ck, cv, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(o.reshape(2, 2, 2, 200, 64), torch.from_dlpack(o2))
    torch.testing.assert_close(lse.reshape(2, 2, 2, 200), torch.from_dlpack(m2 + cupy.log(l2)))
    dq2, dk2, dv2 = cupyflash.flash_attention_backward(cdo.reshape(o2.shape), cq5, ck, cv, o2, m2, l2, causal=True)
    for got, want in zip(grads, (dq2, dk2, dv2)):
        torch.testing.assert_close(got, torch.from_dlpack(want).reshape(got.shape), rtol=2e-2, atol=2e-3)


@gpu_test
@needs_torch_cuda
def test_gpu_runs_on_the_current_stream_without_synchronising():
    """On a side stream kept busy by a sleep kernel: the inputs are written on that stream after the sleep
    (a kernel on any other stream would read them unwritten), both passes return while the stream is
    still busy, and the results are right once it drains. A first round on the stream, not busy, fills
    torch's and CuPy's pools for it, so the busy round allocates nothing from the driver."""
    q, k, v, do = random_qkv((2, 4, 256, 64), (2, 4, 256, 64), torch.bfloat16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for busy in (False, True):
            if busy:
                torch.cuda._sleep(200_000_000)   # about 0.1 s of GPU clock cycles
            q2, k2, v2 = (x.detach().mul(1).requires_grad_() for x in (q, k, v))
            o = flash_attention(q2, k2, v2, causal=True)
            grads = torch.autograd.grad(o, (q2, k2, v2), do)
        still_busy = not side.query()
    assert still_busy, "a call waited for the stream"
    side.synchronize()
    want = reference_attention(q, k, v, do, causal=True)
    for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (want[0], *want[2:])):
        assert rel_err(to_numpy(got), ref) <= BWD_CEILING["bfloat16"], name


@gpu_test
@needs_torch_cuda
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gpu_gradients_through_lse_match_the_cpu_path(layout):
    """A loss of o and lse, with a sink: float32 on the GPU against the same call in float64 on the CPU (the
    NumPy path, which gradcheck holds)."""
    q, k, v, do = random_qkv((2, 4, 120, 64), (2, 2, 120, 64), torch.float32, "cuda", layout)
    sink = torch.randn(4, device="cuda", requires_grad=True)
    weights = torch.randn(2, 4, 120, device="cuda")

    def grads(q, k, v, sink, weights, do):
        o, lse = flash_attention(q, k, v, causal=True, sink=sink, layout=layout, return_lse=True)
        return torch.autograd.grad((o * do).sum() + (lse * weights).sum(), (q, k, v, sink))

    got = grads(q, k, v, sink, weights, do)
    cpu = [x.detach().to("cpu", torch.float64).requires_grad_(x.requires_grad) for x in (q, k, v, sink, weights, do)]
    want = grads(*cpu)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel_err(to_numpy(g), to_numpy(w)) <= 1e-4, name


@gpu_test
@needs_torch_cuda
def test_gpu_modifiers_and_packed_sequences_match_the_reference():
    """Sinks, ALiBi, a bias with its gradient and packed sequences on the GPU, against the float64 reference."""
    q, k, v, do = random_qkv((2, 4, 100, 64), (2, 2, 100, 64), torch.float32, "cuda")
    sink = torch.randn(4, device="cuda", requires_grad=True)
    bias = torch.randn(1, 4, 100, 100, device="cuda", requires_grad=True)
    slopes = torch.rand(4, device="cuda")
    o = flash_attention(q, k, v, causal=True, sink=sink, bias=bias, alibi_slopes=slopes)
    got = torch.autograd.grad(o, (q, k, v, bias, sink), do)
    kw = dict(causal=True, sink=to_numpy(sink), alibi_slopes=to_numpy(slopes),
              bias=numpy.broadcast_to(to_numpy(bias), (2, 4, 100, 100)))
    qn, don = to_numpy(q), to_numpy(do)
    kr, vr = (numpy.repeat(to_numpy(x), 2, axis=1) for x in (k, v))
    o_ref, m, l = reference.attention_forward(qn, kr, vr, **kw)
    dq, dk, dv, dbias, dsink = reference.attention_backward(don, qn, kr, vr, o_ref, m, l, bias_grad=True, **kw)
    dk, dv = (g.reshape(2, 2, 2, 100, 64).sum(2) for g in (dk, dv))
    for name, g, w in zip(("o", "dq", "dk", "dv", "dbias", "dsink"), (o, *got),
                          (o_ref, dq, dk, dv, dbias.sum(0, keepdims=True), dsink)):
        assert rel_err(to_numpy(g), w) <= 1e-4, name
    cu = torch.tensor([0, 30, 30, 100], dtype=torch.int32, device="cuda")
    qv, kv_, vv = (x.detach()[0].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v))   # (total, H, D)
    ov = flash_attention_varlen(qv, kv_, vv, cu, cu, 70, 70, causal=True)
    qn, kn, vn = to_numpy(qv).swapaxes(0, 1), *(numpy.repeat(to_numpy(x).swapaxes(0, 1), 2, axis=0) for x in (kv_, vv))
    o_ref, _, _ = reference.attention_varlen_forward(qn, kn, vn, cu.cpu().numpy(), cu.cpu().numpy(), causal=True)
    assert rel_err(to_numpy(ov), o_ref.swapaxes(0, 1)) <= 1e-5


# ---------------------------------------------------------------------------
# The benchmarks' CPU side

def run_script(*argv):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_training_benchmark_explains_itself_without_a_gpu():
    done = run_script("benchmarks/train_step.py", "--help")
    assert done.returncode == 0 and "--large" in done.stdout, done.stderr


def test_the_training_benchmarks_model_gives_one_loss_with_either_attention():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train_step
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cfg = train_step.Config(batch=2, heads=2, seq=32, head_dim=16, layers=2)
    torch.manual_seed(0)
    state = train_step.torch_model(cfg, None).state_dict()
    tokens = torch.randint(0, train_step.VOCAB, (2, cfg.seq + 1))
    losses, grads = [], []
    for attend in train_step.torch_attentions().values():
        model = train_step.torch_model(cfg, attend)
        model.load_state_dict(state)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, train_step.VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
        grads.append(model.blocks[0].qkv.weight.grad)
    assert abs(losses[0] - losses[1]) < 1e-5
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_the_host_cost_benchmark_runs_on_the_cpu():
    done = run_script("benchmarks/torch_host_cost.py", "--calls", "40")
    assert done.returncode == 0 and "forward + backward through autograd" in done.stdout, done.stdout + done.stderr


@gpu_test
@needs_torch_cuda
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_kvcache_equals_cupyflash_on_the_same_memory(layout, paged):
    """On CUDA tensors, o, lse and the appended caches equal cupyflash's own call on CuPy arrays of the same
    values, bit for bit (fp16, GQA, a paged cache's shuffled pages), queued on torch's current stream."""
    import cupy

    from cupyflash.torch import flash_attention_with_kvcache as torch_kvcache

    q, kc, vc, lens, k, v, table = kvcache_case(numpy.random.default_rng(5), paged, numpy.float16, D=64, N_max=256,
                                                page=16)
    want_kc, want_vc = cupy.asarray(kc), cupy.asarray(vc)
    want = cupyflash.flash_attention_with_kvcache(cupy.asarray(q), want_kc, want_vc, cupy.asarray(lens),
                                                  k=cupy.asarray(k), v=cupy.asarray(v),
                                                  block_table=None if table is None else cupy.asarray(table))
    tq, tkc, tvc, tk, tv = (as_layout(x, layout).cuda() for x in (q, kc, vc, k, v))
    tlens, ttable = torch.from_numpy(lens).cuda(), None if table is None else torch.from_numpy(table).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        o, lse = torch_kvcache(tq, tkc, tvc, tlens, tk, tv, block_table=ttable, layout=layout, return_lse=True)
    stream.synchronize()
    assert numpy.array_equal(bhnd(o, layout).cpu().numpy(), want[0].get())
    numpy.testing.assert_allclose(lse.cpu().numpy(), (want[1] + cupy.log(want[2])).get(), rtol=1e-6)
    for got, expected in ((tkc, want_kc), (tvc, want_vc)):
        assert numpy.array_equal(bhnd(got, layout).cpu().numpy(), expected.get())
