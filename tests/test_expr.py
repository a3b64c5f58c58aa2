"""The user expressions' language (``cupyflash._expr``): worked values of C's meaning, the refusals,
and random expressions evaluated by NumPy against the same text compiled by the host's C++ compiler."""

import shutil
import subprocess

import numpy
import pytest

from cupyflash import _expr

NAMES = {"s": ("float", False), "b": ("int", False), "q_idx": ("int", False), "kv_idx": ("int", False),
         "w": ("float", True)}
W = numpy.array([0.5, -1.25, 2.0, 3.5])


def grid():
    """Every (b, q_idx, kv_idx, s) of a small grid, as broadcast arrays."""
    b, q, k, s = numpy.meshgrid(numpy.arange(2), numpy.arange(-3, 5), numpy.arange(7),
                                numpy.array([-2.5, -0.75, 0.0, 1.0, 3.25]), indexing="ij")
    return {"b": b, "q_idx": q, "kv_idx": k, "s": s.astype(numpy.float64), "w": W}


def value(text, **env):
    return _expr.parse(text, NAMES).evaluate({**grid(), **env} if not env else {"w": W, **env})


@pytest.mark.parametrize("text, expected", [
    ("-7 / 2", -3), ("-7 % 3", -1), ("7 % -3", 1), ("7 / 2 * 2", 6), ("7.0f / 2", 3.5), ("1 + 2 * 3", 7),
    ("1 < 2 == 1", 1), ("0 ? 1 : 0 ? 2 : 3", 3), ("!0 + !5", 1), ("(int)-2.75f", -2), ("(float)7 / 2", 3.5),
    ("max(3, 9) - min(3.5, 2)", 7.0), ("abs(-4) % 3", 1), ("0x10 + 1e1", 26.0), ("- -3", 3),
    ("1 || 1 / 0", 1), ("0 && 1 / 0", 0), ("5 > 3 ? w[2] : w[9]", 2.0), ("tanhf(0.0f) + expf(0)", 1.0),
])
def test_worked_values_follow_c(text, expected):
    got = value(text, q_idx=numpy.int64(0))
    assert got == expected and (isinstance(expected, float) or numpy.asarray(got).dtype.kind == "i")


@pytest.mark.parametrize("text, words", [
    ("s +", "unexpected end"), ("foo(s)", "unknown function 'foo'"), ("w", "w is an array"),
    ("s % 2", "% needs ints"), ("x * s", "unknown name 'x'"), ("expf(s, s)", "expf takes 1 argument, got 2"),
    ("s[1]", "s is not an array"), ("w[s]", "needs an int index"), ("s $ 2", "cannot read '$ 2'"),
    ("(s", "expected ')'"), ("s s", "unexpected 's'"),
])
def test_expressions_outside_the_language_are_refused_naming_them(text, words):
    with pytest.raises(ValueError) as raised:
        _expr.parse(text, NAMES, "score_mod")
    assert words in str(raised.value) and "score_mod" in str(raised.value)


def test_a_read_outside_an_array_or_a_division_by_zero_where_evaluated_is_an_error():
    with pytest.raises(ValueError, match="w\\[4\\] reads outside w, of 4 elements"):
        value("kv_idx < 5 ? w[kv_idx] : 0")
    with pytest.raises(ValueError, match="int division by zero"):
        value("q_idx / kv_idx")
    numpy.testing.assert_array_equal(value("kv_idx < 4 ? w[kv_idx] : 0")[0, 0, :, 0], [*W, 0, 0, 0])
    g = grid()   # q_idx % 0 is never evaluated
    expected = (g["kv_idx"] != 0) & (numpy.fmod(g["q_idx"], numpy.maximum(g["kv_idx"], 1)) != 0)
    numpy.testing.assert_array_equal(value("kv_idx && q_idx % kv_idx"), expected)


def random_expression(rng, depth, want_int=False) -> str:
    """Random text of the language (no float-to-int casts: their NaN and overflow are C's undefined
    behaviour), ints kept small."""
    if depth == 0 or rng.random() < 0.2:
        if want_int or rng.random() < 0.4:
            return str(rng.choice(["q_idx", "kv_idx", "b", str(rng.integers(0, 10)), "0x3"]))
        return str(rng.choice(["s", "1.5f", "0.25", "2e-1", f"w[abs({random_expression(rng, 0, True)}) % 4]"]))
    sub = lambda i=False: random_expression(rng, depth - 1, i)   # noqa: E731
    if want_int:
        op = rng.choice(["+", "-", "*", "/", "%", "<", "==", "&&", "||"])
        return f"({sub(True)} {op} {sub(True)})" if rng.random() < 0.8 else f"(!{sub()})"
    form = rng.integers(0, 6)
    if form == 0:
        return f"({sub()} ? {sub()} : {sub()})"
    if form == 1:
        name = rng.choice(["tanhf", "expf", "fabsf", "cosf", "floorf", "abs"])
        return f"{name}({sub()} * 0.1f)" if name in ("expf",) else f"{name}({sub()})"
    if form == 2:
        return f"{rng.choice(['fminf', 'fmaxf', 'max', 'min'])}({sub()}, {sub()})"
    if form == 3:
        return f"-(float){sub(True)}"
    return f"({sub()} {rng.choice(['+', '-', '*', '/', '<=', '!='])} {sub()})"


HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#define float double
#define expf exp
#define exp2f exp2
#define logf log
#define log2f log2
#define sqrtf sqrt
#define tanhf tanh
#define sinf sin
#define cosf cos
#define floorf floor
#define ceilf ceil
#define fabsf fabs
#define fminf fmin
#define fmaxf fmax
#define powf pow
template <class A, class B> auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> auto max(A a, B b) { return a > b ? a : b; }
long long abs(long long x) { return x < 0 ? -x : x; }
const double w[4] = {0.5, -1.25, 2.0, 3.5};
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_random_expressions_evaluate_as_the_compiled_c(tmp_path):
    """200 random expressions: NumPy's evaluation equals the C++ compiler's of the ``cuda`` text (in
    double, as the reference computes), element by element over the grid."""
    rng = numpy.random.default_rng(0)
    env = grid()
    cases = []
    while len(cases) < 200:
        tree = _expr.parse(random_expression(rng, 4), NAMES)
        try:
            with numpy.errstate(all="ignore"):
                cases.append((tree, numpy.broadcast_to(tree.evaluate(env), env["s"].shape).astype(numpy.float64)))
        except _expr.ExprError:
            continue   # a division by zero where evaluated: C's undefined behaviour
    body = "".join(f"static double f{n}(double s, long long b, long long q_idx, long long kv_idx) "
                   f"{{ return (double)({tree.cuda}); }}\n" for n, (tree, _) in enumerate(cases))
    loop = ("int main() { for (long long b = 0; b < 2; ++b) for (long long q = -3; q < 5; ++q)"
            " for (long long k = 0; k < 7; ++k) for (double s : {-2.5, -0.75, 0.0, 1.0, 3.25}) {\n"
            + "".join(f'printf("%.17g\\n", f{n}(s, b, q, k));\n' for n in range(len(cases))) + "} }\n")
    source = tmp_path / "exprs.cpp"
    source.write_text(HARNESS + body + loop)
    subprocess.run(["g++", "-std=c++17", "-O0", "-w", "-o", str(tmp_path / "exprs"), str(source)], check=True)
    out = subprocess.run([str(tmp_path / "exprs")], check=True, capture_output=True, text=True).stdout.split()
    got = numpy.array([float(x) for x in out]).reshape(-1, len(cases))   # (grid point, expression)
    for n, (tree, expected) in enumerate(cases):
        numpy.testing.assert_allclose(got[:, n], expected.ravel(), rtol=1e-6, atol=1e-9, equal_nan=True,
                                      err_msg=tree.cuda)


def nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as error:   # no CuPy or no NVRTC library on this machine
        pytest.skip(f"needs CuPy's NVRTC: {error}")
    return nvrtc


def test_every_expression_of_the_language_compiles_for_the_gpu():
    """The CUDA text of 200 random expressions in float and in double, typed as the kernels will bind
    the names (``s`` and arrays of the real type, ``b``, ``q_idx``, ``kv_idx`` long long), compiles
    with NVRTC for sm_90 (no GPU needed)."""
    nvrtc = nvrtc_or_skip()
    rng = numpy.random.default_rng(1)
    trees = [_expr.parse(random_expression(rng, 4), NAMES) for _ in range(200)]
    trees += [_expr.parse(text, NAMES) for text in ("max(q_idx, b)", "min(b, 3)", "abs(b - q_idx)", "b % 3",
                                                    "(int)s / 2", "q_idx ? s : 1")]
    # the fast form (16-bit inputs' kernels) beside a stand-in for score_mod.cuh's tanh_acc
    source = "__device__ float tanh_acc(float x) { float r; asm(\"tanh.approx.f32 %0, %1;\" : \"=f\"(r) : \"f\"(x)); return r; }\n"
    source += "".join(f"__device__ {real} {real}{n}{'f' * fast}({real} s, long long b, long long q_idx, long long kv_idx, "
                      f"const {real}* w) {{ return ({real})({tree.render(real, fast)}); }}\n"
                      for real, fast in (("float", False), ("double", False), ("float", True))
                      for n, tree in enumerate(trees))
    prog = nvrtc.createProgram(source, "exprs.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-arch=sm_90", "-default-device"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_the_fast_form_takes_the_hardware_approximations_of_float_functions_and_division():
    """For 16-bit inputs' kernels (``fast``): tanhf as score_mod.cuh's tanh_acc (tanh.approx), expf and the
    like as their intrinsics, float division x / y as x times __fdividef(1.0f, y) (a reciprocal the compiler
    hoists where y is the same for every pair); int division and double kernels keep C's."""
    tree = _expr.parse("c * tanhf(s / c) + expf(-s) / (1 + q_idx / 64)", {**NAMES, "c": ("float", False)})
    fast = tree.render("float", fast=True)
    assert "tanh_acc(" in fast and "__expf(" in fast and fast.count("__fdividef(1.0f, ") == 2 and "(q_idx / 64)" in fast
    assert "(s * __fdividef(1.0f, c))" in fast
    assert "tanhf(" in tree.render("float") and "__fdividef" not in tree.render("float")
    assert tree.render("double", fast=True) == tree.render("double")
    # score_mod_grad's form: the division's reciprocal, C's functions
    grad = tree.render("float", fast_division=True)
    assert "tanhf(" in grad and "expf(" in grad and "tanh_acc" not in grad and "(s * __fdividef(1.0f, c))" in grad
    assert tree.render("double", fast_division=True) == tree.render("double")


def test_score_mod_grad_keeps_c_functions_but_takes_the_fast_division_for_16_bit_kernels():
    """user_code(fast=True): score_mod in the fast form, score_mod_grad with C's tanhf and the division's
    reciprocal; without fast (float32, float64 kernels) both as C writes them."""
    user = _expr.user_mods("c * tanhf(s / c)", "1 - tanhf(s / c) * tanhf(s / c)", None, {"c": 30.0})
    fast = _expr.user_code(user, "float", {}, fast=True)
    assert "tanh_acc(" in fast.score and "__fdividef(1.0f, c)" in fast.score
    assert "tanhf(" in fast.grad and "tanh_acc" not in fast.grad and "__fdividef(1.0f, c)" in fast.grad
    plain = _expr.user_code(user, "float", {})
    assert "__fdividef" not in plain.score + plain.grad and "tanh_acc" not in plain.score
