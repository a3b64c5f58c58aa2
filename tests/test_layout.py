"""Host-side launch logic that needs no GPU: batch collapsing, split choice, tile choice."""

import math

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash import _launch, _tiles
from helpers import faked_gpu_module


def flat_offsets(layout, t):
    """Offsets of tensor t for every flat batch index, as the kernels compute them (split_batch)."""
    n0, n1, n2 = layout.sizes
    s0, s1, s2 = layout.strides[t]
    return [(b // (n1 * n2)) * s0 + ((b // n2) % n1) * s1 + (b % n2) * s2 for b in range(n0 * n1 * n2)]


def reference_offsets(batch_shape, strides):
    return [int(numpy.dot(idx, strides)) if batch_shape else 0 for idx in numpy.ndindex(*batch_shape)]


@st.composite
def broadcast_layouts(draw):
    """A broadcast batch shape and, per tensor, strides of a contiguous array that broadcasts into it."""
    batch = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=5)))
    strides = []
    for _ in range(draw(st.integers(1, 4))):
        own = tuple(n if draw(st.booleans()) else 1 for n in batch)
        drop = draw(st.integers(0, len(own)))
        shape = own[drop:] + (7, 8)                      # fewer leading dims are broadcast too
        strides.append(_launch.batch_strides(shape, _launch.contiguous_strides(shape)[:-2], batch))
    return batch, strides


@settings(max_examples=300, deadline=None)
@given(broadcast_layouts())
def test_collapsed_batch_indexes_the_same_elements(problem):
    batch, strides = problem
    layout = _launch.collapse_batch(batch, strides)
    if layout is None:   # more than three unmergeable dims: the caller peels one off
        assert sum(n > 1 for n in batch) > _launch.MAX_BATCH_DIMS
        return
    assert layout.count == math.prod(batch)
    for t, s in enumerate(strides):
        assert flat_offsets(layout, t) == reference_offsets(batch, s)


def test_gqa_collapses_to_two_dims():
    batch = (2, 4, 3)                                       # (B, Hkv, G)
    q = _launch.contiguous_strides((2, 4, 3, 9, 8))[:-2]
    kv = _launch.batch_strides((2, 4, 1, 9, 8), _launch.contiguous_strides((2, 4, 1, 9, 8))[:-2], batch)
    layout = _launch.collapse_batch(batch, [q, kv])
    assert layout.sizes == (1, 8, 3)
    assert layout.strides[1] == (0, 72, 0)


workspace_parts = st.lists(st.tuples(st.integers(0, 5000), st.booleans()), max_size=8)


@settings(max_examples=200, deadline=None)
@given(workspace_parts)
def test_workspace_parts_are_aligned_apart_and_the_zeroed_ones_one_range(parts):
    """One allocation, one memset: every part 256-byte aligned and disjoint, the zeroed parts exactly
    the range the memset clears, a part of no bytes at no offset."""
    space = _launch.block_layout(parts)
    spans = sorted((off, off + n, zeroed) for off, (n, zeroed) in zip(space.offsets, parts) if n)
    assert all((off is None) == (n == 0) for off, (n, _) in zip(space.offsets, parts))
    assert all(off % _launch.WORKSPACE_ALIGN == 0 for off in space.offsets if off is not None)
    assert all(a_end <= b_start for (_, a_end, _), (b_start, _, _) in zip(spans, spans[1:]))
    assert all(end <= space.nbytes for _, end, _ in spans)
    assert all((start >= space.zero_from) == zeroed for start, _, zeroed in spans)
    assert space.nbytes == sum(-(-n // _launch.WORKSPACE_ALIGN) * _launch.WORKSPACE_ALIGN for n, _ in parts)


@pytest.mark.parametrize("heads, T_r, slots", [(64, 64, 264), (16, 1024, 264), (1, 1, 132), (4096, 1, 264),
                                               (2, 16, 264), (7, 33, 132)])
def test_splits_minimise_tile_steps_over_waves(heads, T_r, slots):
    def cost(n):
        return math.ceil(heads * n / slots) * math.ceil(T_r / n)

    n = _launch.choose_splits(heads, T_r, slots)
    assert 1 <= n <= T_r
    assert cost(n) == min(cost(m) for m in range(1, T_r + 1))
    assert all(cost(m) > cost(n) for m in range(1, n))      # smallest on ties


@pytest.mark.parametrize("head_dim, bucket", [(1, 32), (32, 32), (33, 64), (72, 96), (96, 96), (129, 192),
                                              (200, 256), (256, 256)])
def test_head_dim_buckets(head_dim, bucket):
    assert _tiles.head_dim_bucket(head_dim) == bucket


def test_head_dim_past_the_last_bucket_raises():
    with pytest.raises(ValueError, match="257"):
        _tiles.head_dim_bucket(257)


H100_SMEM = 227 * 1024


@pytest.mark.parametrize("dtype", list(_tiles.DTYPE_CODES))
def test_auto_forward_names_a_schedule_for_every_head_dim(dtype):
    schedules = {_tiles.auto_forward(d, dtype) for d in range(1, _tiles.MAX_HEAD_DIM + 1)}
    assert schedules <= {"v1", "v2"}
    for bucket, schedule in _tiles.AUTO_FORWARD[_tiles._precision_class(dtype)]:
        assert _tiles.auto_forward(bucket, dtype) == schedule


def test_auto_forward_keeps_v1_for_float64_past_128():
    assert _tiles.auto_forward(128, "float64") == "v2"
    assert _tiles.auto_forward(129, "float64") == "v1"
    assert _tiles.auto_forward(256, "float32") == "v2"


@pytest.mark.parametrize("kernel", ["fwd_sm90", "bwd_sm90", "bwd_sm90_wide"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hopper_kernels_take_16_bit_only(kernel, dtype):
    with pytest.raises(ValueError, match=kernel):
        _tiles.choose_tiles(kernel, 64, dtype, H100_SMEM)


@pytest.mark.parametrize("head_dim", [129, 192, 256])
def test_hopper_backward_stops_at_128(head_dim):
    with pytest.raises(ValueError, match="D <= 128"):
        _tiles.choose_tiles("bwd_sm90", head_dim, "bfloat16", H100_SMEM)


@pytest.mark.parametrize("head_dim", [1, 64, 128])
def test_wide_hopper_backward_starts_past_128(head_dim):
    with pytest.raises(ValueError, match="129 <= D <= 256"):
        _tiles.choose_tiles("bwd_sm90_wide", head_dim, "float16", H100_SMEM)


@pytest.mark.parametrize("head_dim, d_pad, stages", [(129, 192, 2), (160, 192, 2), (192, 192, 2), (193, 256, 1),
                                                     (256, 256, 1)])
def test_wide_hopper_backward_tiles(head_dim, d_pad, stages):
    """Two consumers sharing 64 keys and 64 queries per step; the Q_i, dO_i ring doubled where it fits."""
    cfg = _tiles.choose_tiles("bwd_sm90_wide", head_dim, "bfloat16", H100_SMEM)
    assert (cfg.d_pad, cfg.block_r, cfg.block_c, cfg.warps, cfg.q_stages) == (d_pad, 64, 64, 12, stages)
    assert cfg.smem_bytes <= H100_SMEM < _tiles._bwd_sm90_wide_bytes(cfg, stages + 1)
    assert f"-DFLASH_Q_STAGES={stages}" in cfg.defines() and cfg.registers == (24, 240)


@pytest.mark.parametrize("kernel", ["fwd_sm90", "bwd_sm90"])
@pytest.mark.parametrize("head_dim", [1, 33, 64, 65, 96, 128])
def test_hopper_tiles_pad_to_swizzle_blocks_and_fit(kernel, head_dim):
    """Whole 64-column swizzle blocks, warpgroups of 64 rows plus a producer, within an H100/H200 block."""
    cfg = _tiles.choose_tiles(kernel, head_dim, "float16", H100_SMEM)
    assert cfg.d_pad == -(-_tiles.head_dim_bucket(head_dim) // 64) * 64   # its bucket, up to a 64 multiple
    rows = cfg.block_r if kernel == "fwd_sm90" else cfg.block_c
    assert rows == 64 * (cfg.warps // 4 - 1) and cfg.smem_bytes <= H100_SMEM
    assert cfg.spec.arch == "sm_90a"
    producer, consumer = cfg.registers   # setmaxnreg's split of the register file, one CTA per SM
    entry = _tiles.REGISTER_FILE // cfg.threads // 8 * 8
    assert producer % 8 == consumer % 8 == 0 and consumer <= 256
    assert producer + (cfg.warps // 4 - 1) * consumer <= (cfg.warps // 4) * entry
    assert f"-DFLASH_CONSUMER_REGS={consumer}" in cfg.defines()


def test_portable_kernels_have_no_arch_and_no_register_split():
    cfg = _tiles.choose_tiles("fwd_v2", 64, "float16", H100_SMEM)
    assert cfg.spec.arch is None and cfg.registers is None
    assert not any("REGS" in d for d in cfg.defines())


@pytest.mark.parametrize("kernel", ["no_such_kernel", "fwd_v2_sm90", "bwd_v1"])
def test_an_unknown_kernel_family_is_refused_by_name(kernel):
    with pytest.raises(ValueError, match="unknown kernel"):
        _tiles.choose_tiles(kernel, 64, "float16", H100_SMEM)


@pytest.mark.parametrize("names", [["fwd_v2_sm90"], ["bwd_v1", "fwd_v1"], ["no_such_family"]])
def test_precompile_refuses_a_name_that_is_no_kernel_family(names):
    """Before it looks for CuPy or a GPU: the error names the families it takes."""
    import cupyflash

    with pytest.raises(ValueError, match="not among the kernel families fwd_v1, fwd_v2, fwd_sm90"):
        cupyflash.precompile(kernels=names)


def test_a_packed_struct_is_the_template_with_the_call_pointers_behind_its_argument_word():
    """``Params.pack``: word 0 is the address of the struct (the one entry of ``kernel_params``), the
    struct holds the plan's fields (nested structs by member name, the others 0) and the call's pointers,
    each where the mirror puts it."""
    from cupyflash import _params

    params = _params.Params(_params.FWD, ("q.ptr", "o", "repair_flags"), q=(1, 2, 3, 4), mask=(5, 6, -5, 1), D=64,
                            mods={"softcap": 2.5, "bias": {"s1": 7, "sj": 1}}, uses=9, scale=0.125)
    buffer, address = params.pack((0x1000, 0x2000, 0x3000))
    raw = bytes(buffer)
    assert int.from_bytes(raw[:8], "little") == address + 8
    struct = numpy.frombuffer(raw[8:], _params.FWD)[0]
    assert (struct["q"]["ptr"], struct["o"], struct["repair_flags"]) == (0x1000, 0x2000, 0x3000)
    assert (struct["q"]["s0"], struct["q"]["sn"], struct["k"]["ptr"], struct["m"]) == (1, 4, 0, 0)
    assert tuple(struct["mask"]) == (5, 6, -5, 1) and struct["D"] == 64 and struct["scale"] == 0.125
    assert struct["mods"]["softcap"] == 2.5 and struct["uses"] == 9
    assert tuple(struct["mods"]["bias"]) == (0, 0, 7, 0, 0, 1) and tuple(struct["mods"]["alibi"]) == (0, 0, 0, 0)
    again, _ = params.pack((0, 8, 0))   # a copy per call: the template is untouched
    assert numpy.frombuffer(bytes(again)[8:], _params.FWD)[0]["o"] == 8
    assert numpy.frombuffer(bytes(again)[8:], _params.FWD)[0]["q"]["ptr"] == 0
    assert numpy.frombuffer(bytes(buffer)[8:], _params.FWD)[0]["o"] == 0x2000
    with pytest.raises(ValueError, match="2 pointers for a struct whose plan names 3"):
        params.pack((1, 2))


@pytest.mark.parametrize("struct, names", [("BWD", "BWD_POINTERS"), ("FWD", "FWD_POINTERS")])
def test_a_call_packs_each_pointer_where_its_name_says(struct, names):
    """The plans' pointers (``FWD_POINTERS``, ``BWD_POINTERS``: the modifiers' arrays' from ``_flags.FLAGS``)
    land in the fields of their names, a 0 among them as 0."""
    from cupyflash import _flags, _launch, _params

    dtype, names = getattr(_params, struct), getattr(_launch, names)
    assert len(set(names)) == len(names)
    assert {f.pointer for f in _flags.ARRAY_FLAGS} <= set(names)
    params = _params.Params(dtype, names)
    given = {name: value if value % 3 else 0 for value, name in enumerate(names, start=1)}
    packed = numpy.frombuffer(bytes(params.pack(tuple(given.values()))[0])[8:], dtype)[0]
    for name in names:
        field = packed
        for part in name.replace("[", ".").replace("]", "").split("."):
            field = field[int(part)] if part.isdigit() else field[part]
        assert field == given[name], name


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_kept_call_writes_each_address_where_the_kernels_read_it(monkeypatch, num_splits):
    """ForwardPlan and BackwardPlan pack a call's addresses in the order FWD_POINTERS and BWD_POINTERS
    name them: decoded from the struct each launch gets (the GPU faked, ``benchmarks/host_path.py``),
    every field holds its array's address: inputs, outputs, ALiBi's slopes, the kept scratch, the
    splits' parts as the merge reads them."""
    pytest.importorskip("cupy")
    from cupyflash import _flags, _launch, _params, api

    host_path = faked_gpu_module()
    gpu = host_path.FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    monkeypatch.setattr(_launch, "PLANS", {})
    compiled = []   # the flags of each kernel a plan loads
    monkeypatch.setattr(_launch, "get_kernels", lambda cfg, load=_launch.get_kernels: compiled.append(cfg.flags) or load(cfg))
    q, k, v, do = (gpu.array((2, 3, 200, 64)) for _ in range(4))
    slopes = gpu.array((3,), numpy.float32)
    prob = api.check_forward(q, k, v, True, None, None)
    kw = dict(causal=True, alibi_slopes=slopes, num_splits=num_splits, dropout_p=0.25, seed=1234)

    def forward_plan_into(out, seed=1234):
        def make(key):
            arrays, _ = api._checked_mods(prob, q, key, api.call_arrays(alibi_slopes=slopes))
            schedule = _launch.forward_schedule("v2" if num_splits > 1 else "auto", prob.D, prob.dtype)
            return api._forward_gpu(q, k, v, arrays, prob.batch_shape, prob, schedule, "highest", key, out,
                                    dropout=(0.25, seed), kv_splits=num_splits)
        return make

    forward_plan = forward_plan_into(None)
    host_path.first_call(lambda: api.flash_attention_forward(q, k, v, **kw), forward_plan)
    gpu.structs.clear()
    o, m, l = api.flash_attention_forward(q, k, v, **dict(kw, seed=4321))
    (plan,) = _launch.PLANS.values()
    fwd = numpy.frombuffer(gpu.structs[0][1][:_params.FWD.itemsize], _params.FWD)[0]
    assert gpu.structs[0][0] == "flash_fwd_sm90"
    assert [fwd[x]["ptr"] for x in "qkv"] == [x.data.ptr for x in (q, k, v)]
    assert [fwd[x] for x in "oml"] == [x.data.ptr for x in (o, m, l)]
    assert fwd["mods"]["alibi"]["ptr"] == slopes.data.ptr and fwd["mods"]["bias"]["ptr"] == 0
    assert fwd["mods"]["seed"] == 4321 and fwd["mods"]["seed_at"] == 0 and fwd["tiles"]["base"] == 0
    scratch = plan.scratch.kept[0].ptr
    assert [fwd["tile_counter"], fwd["repair_flags"]] == plan.scratch.block.pointers(scratch)
    if num_splits == 1:
        assert [name for name, _ in gpu.structs] == ["flash_fwd_sm90"]
        assert fwd["o_parts"] == fwd["m_parts"] == fwd["l_parts"] == 0
    else:   # the main kernel, the merge of its parts into o, m, l, the repair
        assert [name for name, _ in gpu.structs] == ["flash_fwd_sm90", "flash_merge", "flash_fwd_repair"]
        merge = numpy.frombuffer(gpu.structs[1][1][:_params.MERGE.itemsize], _params.MERGE)[0]
        assert [merge[x]["ptr"][0] for x in "oml"] == [fwd[f"{x}_parts"] for x in "oml"] and fwd["o_parts"]
        assert [merge[f"{x}_out"] for x in "oml"] == [x.data.ptr for x in (o, m, l)]
        assert gpu.structs[2][1][:_params.FWD.itemsize] == gpu.structs[0][1][:_params.FWD.itemsize]

    assert "device_seed" not in compiled[0] and not fwd["uses"] & _flags.BY_NAME["device_seed"].bit

    # a device seed, read by the kernels: the struct holds its address instead, and a plan of its own, whose
    # Hopper forward compiles the read in
    device_seed = gpu.array((2,), numpy.uint32)
    seeded_kw = dict(kw, seed=device_seed)
    compiled.clear()
    host_path.first_call(lambda: api.flash_attention_forward(q, k, v, **seeded_kw), forward_plan_into(None, device_seed))
    gpu.structs.clear()
    api.flash_attention_forward(q, k, v, **seeded_kw)
    seeded = numpy.frombuffer(gpu.structs[0][1][:_params.FWD.itemsize], _params.FWD)[0]
    assert (seeded["mods"]["seed"], seeded["mods"]["seed_at"]) == (0, device_seed.data.ptr)
    assert seeded["uses"] & _flags.BY_NAME["device_seed"].bit and len(_launch.PLANS) == 2
    assert "device_seed" in compiled[0]

    # into given outputs (cupyflash.torch's and cupyflash.jax's calls): their addresses, the same parts after them
    given = api.FreshOut((gpu.array(o.shape), gpu.array(m.shape, numpy.float32), gpu.array(l.shape, numpy.float32)))
    host_path.first_call(lambda: api.flash_attention_forward(q, k, v, out=given, **kw), forward_plan_into(given))
    gpu.structs.clear()
    result = api.flash_attention_forward(q, k, v, out=given, **dict(kw, seed=4321))
    assert all(x is y for x, y in zip(result, given))
    into = numpy.frombuffer(gpu.structs[0][1][:_params.FWD.itemsize], _params.FWD)[0]
    assert [into[x] for x in "oml"] == [x.data.ptr for x in given]
    assert [into[x]["ptr"] for x in "qkv"] == [fwd[x]["ptr"] for x in "qkv"] and into["mods"]["seed"] == 4321
    assert (into["o_parts"] != 0) == (num_splits > 1)

    bprob = api.check_backward(do, q, k, v, o, m, l, True, None, None)

    def backward_plan(key):
        arrays, _ = api._checked_mods(bprob, q, key, api.call_arrays(alibi_slopes=slopes))
        return api._backward_gpu(do, q, k, v, o, m, l, arrays, bprob.batch_shape, bprob, "auto", "highest", False,
                                 key)

    host_path.first_call(lambda: api.flash_attention_backward(do, q, k, v, o, m, l, causal=True,
                                                              alibi_slopes=slopes), backward_plan)
    gpu.structs.clear()
    dq, dk, dv = api.flash_attention_backward(do, q, k, v, o, m, l, causal=True, alibi_slopes=slopes)
    bwd = numpy.frombuffer(gpu.structs[0][1][:_params.BWD.itemsize], _params.BWD)[0]
    assert len({raw[:_params.BWD.itemsize] for _, raw in gpu.structs}) == 1   # one struct for every step
    assert [bwd[x]["ptr"] for x in ("q", "k", "v", "o", "dO")] == [x.data.ptr for x in (q, k, v, o, do)]
    assert [bwd["m"], bwd["l"], bwd["dq"], bwd["dk"]["ptr"], bwd["dv"]["ptr"]] == [x.data.ptr for x in (m, l, dq, dk, dv)]
    assert bwd["mods"]["alibi"]["ptr"] == slopes.data.ptr and bwd["mods"]["dbias"]["ptr"] == 0
    (bplan,) = [p for p in _launch.PLANS.values() if isinstance(p, _launch.BackwardPlan)]
    base = bwd["lse2"] - bplan.workspace.offsets[_launch.BWD_PARTS.index("lse2")]   # the workspace's
    assert bwd["zero"][0]["ptr"] == base + bplan.workspace.zero_from


def test_a_backward_with_a_sink_returns_the_rows_sums_its_prep_wrote(monkeypatch):
    """With a sink the backward plan returns, after dq, dk, dv, the rows' D_i = rowsum(dO_i o O_i) where
    flash_bwd_prep wrote them (the struct's Dsum, laid out as m): dsink is formed from those, not from
    another pass over dO and O (the GPU faked, ``benchmarks/host_path.py``)."""
    pytest.importorskip("cupy")
    from cupyflash import _params, api

    gpu = faked_gpu_module().FakeGPU(patch=monkeypatch.setattr, keep_structs=True)
    monkeypatch.setattr(_launch, "PLANS", {})
    q, k, v, do, o = (gpu.array((2, 3, 200, 64)) for _ in range(5))
    m, l = gpu.array((2, 3, 200), numpy.float32), gpu.array((2, 3, 200), numpy.float32)
    sink = gpu.array((3,), numpy.float32)
    prob = api.check_backward(do, q, k, v, o, m, l, True, None, None)
    for arrays, returned in (({}, 3), ({"sink": sink}, 4)):
        gpu.structs.clear()
        grads = api._backward_gpu(do, q, k, v, o, m, l, arrays, prob.batch_shape, prob, "auto", "highest", False)
        assert len(grads) == returned
    bwd = numpy.frombuffer(gpu.structs[0][1][:_params.BWD.itemsize], _params.BWD)[0]
    rows = grads[-1]
    assert (rows.shape, rows.dtype, rows.data.ptr) == (m.shape, m.dtype, bwd["Dsum"])
    assert bwd["mods"]["sink"]["ptr"] == sink.data.ptr
