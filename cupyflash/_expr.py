"""User-written score and mask expressions (``score_mod``, ``score_mod_grad``, ``mask_mod``): one small
language, a subset of C, that NumPy evaluates on the CPU path and NVRTC compiles into the kernels.

An expression is parsed once (``parse``); the tree evaluates over NumPy arrays (``Expr.evaluate``)
and renders as CUDA C (``Expr.render``: float32 or float64 arithmetic), so both paths read the same
text the same way.

The language, with C's precedence and meaning:

- numbers: ints (``64``, ``0x40``) and floats (``0.5``, ``1e-3``, ``2.5f``);
- names: those a caller binds (``s``, ``b``, ``q_idx``, ``kv_idx`` and ``mod_args``' entries), each an
  int (64-bit: ``long long`` in the kernels, int64 in NumPy) or a float; an array (bound as 1-D, C
  order) is read by ``name[index]``;
- ``+ - * / %`` (``/`` of two ints truncates toward zero and ``%`` takes the dividend's sign, as in
  C; ``%`` needs ints), ``< <= > >= == !=``, ``&& || !`` (0 or 1, ints), ``c ? x : y``, unary ``-``,
  casts ``(float)``, ``(int)``, and the functions in ``FUNCTIONS``.

A read ``name[i]`` outside the array is an error where it is evaluated; the branch ``?:``, ``&&`` or
``||`` does not take is not evaluated (as in C), so ``j < n ? w[j] : 0.0f`` is safe.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

INT, FLOAT = "int", "float"

# name: (NumPy function, arity, CUDA name for float arguments, CUDA name for int arguments or None)
FUNCTIONS = {
    "exp": (np.exp, 1, "expf", None), "expf": (np.exp, 1, "expf", None),
    "exp2f": (np.exp2, 1, "exp2f", None), "log": (np.log, 1, "logf", None),
    "logf": (np.log, 1, "logf", None), "log2f": (np.log2, 1, "log2f", None),
    "sqrt": (np.sqrt, 1, "sqrtf", None), "sqrtf": (np.sqrt, 1, "sqrtf", None),
    "tanh": (np.tanh, 1, "tanhf", None), "tanhf": (np.tanh, 1, "tanhf", None),
    "sin": (np.sin, 1, "sinf", None), "sinf": (np.sin, 1, "sinf", None),
    "cos": (np.cos, 1, "cosf", None), "cosf": (np.cos, 1, "cosf", None),
    "floorf": (np.floor, 1, "floorf", None), "ceilf": (np.ceil, 1, "ceilf", None),
    "fabs": (np.abs, 1, "fabsf", None), "fabsf": (np.abs, 1, "fabsf", None),
    "abs": (np.abs, 1, "fabsf", "abs"),
    "fminf": (np.minimum, 2, "fminf", None), "fmaxf": (np.maximum, 2, "fmaxf", None),
    "min": (np.minimum, 2, "fminf", "min"), "max": (np.maximum, 2, "fmaxf", "max"),
    "powf": (np.power, 2, "powf", None), "pow": (np.power, 2, "powf", None),
}
CASTS = {"float": FLOAT, "double": FLOAT, "int": INT}

_TOKEN = re.compile(r"\s*(?:(?P<num>0[xX][0-9a-fA-F]+|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fF]?)"
                    r"|(?P<name>[A-Za-z_]\w*)|(?P<op>&&|\|\||[<>=!]=|[-+*/%<>!?:()\[\],]))")
_BINARY = [("||",), ("&&",), ("==", "!="), ("<", "<=", ">", ">="), ("+", "-"), ("*", "/", "%")]


class ExprError(ValueError):
    """An expression outside the language, or a name or read it cannot bind."""


@dataclass(frozen=True)
class Expr:
    """A parsed expression: ``op`` and its operands ``args`` (subtrees, or a number's value or a name)."""
    op: str
    args: tuple
    kind: str

    def evaluate(self, env: dict, active=True):
        """The value over NumPy arrays: ``env`` maps each name to an array (broadcast against the others)
        or, for an indexed name, a 1-D array; ``active`` (bool, broadcastable) marks the elements C would
        evaluate."""
        op, a = self.op, self.args
        if op == "num":
            return np.float64(a[0]) if self.kind == FLOAT else np.int64(a[0])
        if op == "name":
            return env[a[0]]
        if op == "index":
            array = env[a[0]]
            i = np.asarray(a[1].evaluate(env, active))
            live = np.broadcast_to(active, np.broadcast_shapes(np.shape(active), i.shape))
            i = np.broadcast_to(i, live.shape)
            if ((i < 0) | (i >= array.size))[live].any():
                bad = i[live & ((i < 0) | (i >= array.size))].flat[0]
                raise ExprError(f"{a[0]}[{bad}] reads outside {a[0]}, of {array.size} elements")
            return array[np.where(live, i, 0)]
        if op == "cast":
            x = a[0].evaluate(env, active)
            return np.asarray(x, np.float64) if self.kind == FLOAT else np.trunc(x).astype(np.int64)
        if op == "call":
            func = FUNCTIONS[a[0]][0]
            return func(*(_float_if(x.evaluate(env, active), self.kind) for x in a[1:]))
        if op == "?:":
            cond = a[0].evaluate(env, active) != 0
            x, y = a[1].evaluate(env, active & cond), a[2].evaluate(env, active & ~cond)
            return np.where(cond, x, y)
        if op == "!":
            return (a[0].evaluate(env, active) == 0).astype(np.int64)
        if op == "neg":
            return -a[0].evaluate(env, active)
        x = a[0].evaluate(env, active)
        if op in ("&&", "||"):
            left = x != 0
            right = a[1].evaluate(env, active & (left if op == "&&" else ~left)) != 0
            return (left & right if op == "&&" else left | right).astype(np.int64)
        y = a[1].evaluate(env, active)
        if op in ("<", "<=", ">", ">=", "==", "!="):
            return _COMPARE[op](x, y).astype(np.int64)
        if op in ("/", "%") and self.kind == INT:
            shape = np.broadcast_shapes(np.shape(active), np.shape(y))
            if (np.broadcast_to(y, shape) == 0)[np.broadcast_to(active, shape)].any():
                raise ExprError("an int division by zero")
            y = np.where(y == 0, 1, y)
            quotient = np.sign(x) * np.sign(y) * (np.abs(x) // np.abs(y))
            return quotient if op == "/" else x - y * quotient
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return _ARITH[op](x, y)

    @cached_property
    def names(self) -> frozenset:
        """The names the expression reads, arrays included."""
        own = {self.args[0]} if self.op in ("name", "index") else set()
        return frozenset(own.union(*(x.names for x in self.args if isinstance(x, Expr))))

    @property
    def cuda(self) -> str:
        """``render("float")``: the expression in CUDA C for float32 kernels."""
        return self.render("float")

    def render(self, real: str = "float", fast: bool = False, fast_division: bool | None = None) -> str:
        """The expression in CUDA C, fully parenthesised, its float arithmetic in ``real`` ("float":
        literals as ``1.5f`` and the functions' float forms, ``expf``; "double": ``1.5`` and ``exp``);
        ints as ``long long``. ``fast`` (float only; the kernels of 16-bit inputs): the functions of
        ``FAST`` as the hardware's approximations and, unless ``fast_division`` is False, float division
        ``x / y`` as ``x * __fdividef(1.0f, y)`` (a reciprocal the compiler computes once where ``y`` does
        not change from pair to pair; ``fast_division`` alone: that but C's functions)."""
        fast_division = fast if fast_division is None else fast_division
        return _render(self, real, fast and real == "float", fast_division and real == "float")

    def _render(self, real: str, fast: bool, fast_division: bool) -> str:
        op, a = self.op, self.args

        def sub(x: Expr, kind: str = INT) -> str:   # a subtree, converted to ``real`` where ``kind`` is FLOAT
            text = x.render(real, fast, fast_division)
            return f"(({real}){text})" if kind == FLOAT and x.kind == INT else text

        if op == "num":
            return (f"{float(a[0])!r}{'f' * (real == 'float')}" if self.kind == FLOAT else f"{int(a[0])}")
        if op == "name":
            return a[0]
        if op == "index":
            return f"{a[0]}[{sub(a[1])}]"
        if op == "cast":
            return f"(({real if self.kind == FLOAT else 'long long'}){sub(a[0])})"
        if op == "call":
            _, _, float_name, int_name = FUNCTIONS[a[0]]
            if self.kind == INT:   # one overload: every int argument as long long
                return f"{int_name}({', '.join(f'((long long){sub(x)})' for x in a[1:])})"
            name = float_name if real == "float" else float_name[:-1]   # expf -> exp
            name = FAST.get(name, name) if fast else name
            return f"{name}({', '.join(sub(x, FLOAT) for x in a[1:])})"
        if op == "?:":
            return f"({sub(a[0])} ? {sub(a[1], self.kind)} : {sub(a[2], self.kind)})"
        if op == "!":
            return f"(!{sub(a[0])})"
        if op == "neg":
            return f"(-{sub(a[0])})"
        if fast_division and op == "/" and self.kind == FLOAT:   # a divisor the loop does not change: one reciprocal
            return f"({sub(a[0], FLOAT)} * __fdividef(1.0f, {sub(a[1], FLOAT)}))"
        return f"({sub(a[0])} {op} {sub(a[1])})"


# The kernels of float16 and bfloat16 inputs take these functions as the hardware's approximations, as
# the built-in softcap takes tanh.approx (score_mod.cuh: tanh_acc, relative error 2^-11): errors of the
# order of rounding a score to 16 bits, one MUFU instruction each where C's forms take several
FAST = {"tanhf": "tanh_acc", "expf": "__expf", "logf": "__logf", "powf": "__powf", "sinf": "__sinf",
        "cosf": "__cosf"}


@lru_cache(maxsize=1024)
def _render(expr: Expr, real: str, fast: bool, fast_division: bool) -> str:
    return expr._render(real, fast, fast_division)


_COMPARE = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
            "!=": np.not_equal}
_ARITH = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide}


def _float_if(x, kind):
    return np.asarray(x, np.float64) if kind == FLOAT else x


def parse(text: str, names: dict, what: str = "expression") -> Expr:
    """The tree of ``text``. ``names`` maps each name it may use to ``(kind, is_array)``; ``what`` names
    the expression in errors (``score_mod``, say). Raises ``ExprError`` (a ``ValueError``) naming the
    expression and where it stops."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str (a C expression), got {type(text).__name__}")
    return _parse(text, tuple(sorted(names.items())), what)


@lru_cache(maxsize=256)
def _parse(text: str, names: tuple, what: str) -> Expr:
    """``parse``, once per text and names (a call's expressions are parsed at its first like call)."""
    names = dict(names)
    tokens, pos = [], 0
    while pos < len(text.rstrip()):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ExprError(f"{what}: cannot read {text[pos:].strip()[:20]!r} (at character {pos})")
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        pos = match.end()
    parser = _Parser(tokens, names, what, text)
    tree = parser.ternary()
    if parser.i != len(tokens):
        parser.fail("unexpected " + repr(tokens[parser.i][1]))
    return tree


class _Parser:
    def __init__(self, tokens, names, what, text):
        self.tokens, self.names, self.what, self.text, self.i = tokens, names, what, text, 0

    def fail(self, message):
        raise ExprError(f"{self.what}: {message} in {self.text!r}")

    def peek(self):
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self, expected=None):
        if self.i >= len(self.tokens):
            self.fail("unexpected end" + (f", expected {expected!r}" if expected else ""))
        token = self.tokens[self.i][1]
        if expected is not None and token != expected:
            self.fail(f"expected {expected!r}, got {token!r}")
        self.i += 1
        return token

    def ternary(self):
        cond = self.binary(0)
        if self.peek() != "?":
            return cond
        self.take("?")
        x = self.ternary()
        self.take(":")
        y = self.ternary()
        return Expr("?:", (cond, x, y), FLOAT if FLOAT in (x.kind, y.kind) else INT)

    def binary(self, level):
        if level == len(_BINARY):
            return self.unary()
        x = self.binary(level + 1)
        while self.peek() in _BINARY[level]:
            op = self.take()
            y = self.binary(level + 1)
            if op == "%" and FLOAT in (x.kind, y.kind):
                self.fail("% needs ints")
            logical = op in _COMPARE or op in ("&&", "||")
            x = Expr(op, (x, y), INT if logical or (x.kind == y.kind == INT) else FLOAT)
        return x

    def unary(self):
        token = self.peek()
        if token in ("-", "+", "!"):
            self.take()
            x = self.unary()
            return x if token == "+" else Expr("neg" if token == "-" else "!", (x,), x.kind if token == "-" else INT)
        if token == "(" and self.i + 2 < len(self.tokens) and self.tokens[self.i + 1][1] in CASTS \
                and self.tokens[self.i + 2][1] == ")":
            self.i += 1
            kind = CASTS[self.take()]
            self.take(")")
            return Expr("cast", (self.unary(),), kind)
        return self.postfix()

    def postfix(self):
        kind, token = self.tokens[self.i] if self.i < len(self.tokens) else (None, None)
        if token is None:
            self.fail("unexpected end")
        self.i += 1
        if kind == "num":
            is_float = any(c in token for c in ".eEfF") and not token.lower().startswith("0x")
            value = float(token.rstrip("fF")) if is_float else int(token, 0)
            return Expr("num", (value,), FLOAT if is_float else INT)
        if token == "(":
            x = self.ternary()
            self.take(")")
            return x
        if kind != "name":
            self.fail(f"unexpected {token!r}")
        if self.peek() == "(":
            return self.call(token)
        if token not in self.names:
            self.fail(f"unknown name {token!r} (known: {', '.join(sorted(self.names))})")
        name_kind, is_array = self.names[token]
        if is_array:
            if self.peek() != "[":
                self.fail(f"{token} is an array: read it as {token}[index]")
            self.take("[")
            index = self.ternary()
            self.take("]")
            if index.kind != INT:
                self.fail(f"{token}[...] needs an int index")
            return Expr("index", (token, index), name_kind)
        if self.peek() == "[":
            self.fail(f"{token} is not an array")
        return Expr("name", (token,), name_kind)

    def call(self, name):
        if name not in FUNCTIONS:
            self.fail(f"unknown function {name!r} (known: {', '.join(sorted(FUNCTIONS))})")
        self.take("(")
        args = [self.ternary()]
        while self.peek() == ",":
            self.take(",")
            args.append(self.ternary())
        self.take(")")
        _, arity, _, int_name = FUNCTIONS[name]
        if len(args) != arity:
            self.fail(f"{name} takes {arity} argument{'s' * (arity > 1)}, got {len(args)}")
        kind = INT if int_name is not None and all(x.kind == INT for x in args) else FLOAT
        return Expr("call", (name, *args), kind)


# names the expressions bind themselves, and words a mod_args name may not take (CUDA C keywords and
# the language's functions)
INDEX_NAMES = {"b": (INT, False), "q_idx": (INT, False), "kv_idx": (INT, False)}
SCORE_NAMES = {"s": (FLOAT, False), **INDEX_NAMES}
_RESERVED = {"auto", "bool", "break", "case", "char", "const", "continue", "default", "do", "double", "else",
             "enum", "extern", "false", "float", "for", "goto", "if", "int", "long", "return", "short", "signed",
             "sizeof", "static", "struct", "switch", "true", "unsigned", "void", "volatile", "while", "args",
             *FUNCTIONS}


@dataclass(frozen=True)
class UserMods:
    """A call's user expressions, parsed, and the ``mod_args`` they read (name: an array as given, NumPy
    or CuPy, or a number as int64 / float64); ``host_args`` holds them as NumPy evaluates them. ``score`` (``score_mod``) maps the score after the
    softcap to a new one; ``grad`` (``score_mod_grad``) is its derivative by ``s``; ``mask``
    (``mask_mod``) is nonzero where a pair stays visible. Positions: ``b`` the flat batch index,
    ``q_idx``, ``kv_idx`` the query's and key's positions in their problem (in their sequence, packed)."""
    score: Expr | None
    grad: Expr | None
    mask: Expr | None
    args: dict

    @cached_property
    def host_args(self) -> dict:
        """``args`` as NumPy reads them: arrays flat in C order, as int64 or float64 (a CuPy array is
        copied to the host, once)."""
        out = {}
        for name, value in self.args.items():
            if np.ndim(value) == 0 and not hasattr(value, "__cuda_array_interface__"):
                out[name] = value
                continue
            array = np.asarray(value.get() if hasattr(value, "__cuda_array_interface__") else value).reshape(-1)
            out[name] = array.astype(np.float64 if _kind_of(array.dtype) == FLOAT else np.int64)
        return out

    def env(self, b, rows, cols, s=None) -> dict:
        """The names of the tile ``rows`` x ``cols`` (ranges) of batch entries ``b`` ((*batch, 1, 1))."""
        env = {**self.host_args, "b": b, "q_idx": np.arange(rows.start, rows.stop)[:, None],
               "kv_idx": np.arange(cols.start, cols.stop)[None, :]}
        return env if s is None else {**env, "s": s}

    def scores(self, s, b, rows, cols):
        """``score_mod`` of the tile's scores ``s`` (*batch, B_r, B_c), in their dtype."""
        return np.broadcast_to(self.score.evaluate(self.env(b, rows, cols, s)), s.shape).astype(s.dtype)

    def derivative(self, s, b, rows, cols):
        """``score_mod_grad`` at the tile's scores ``s`` (before ``score_mod``), in their dtype."""
        return np.broadcast_to(self.grad.evaluate(self.env(b, rows, cols, s)), s.shape).astype(s.dtype)

    def visible(self, b, rows, cols):
        """``mask_mod`` of the tile, bool, broadcastable to (*batch, B_r, B_c)."""
        return np.asarray(self.mask.evaluate(self.env(b, rows, cols))) != 0


def flat_batch_index(batch) -> np.ndarray:
    """``b`` of every entry of the batch shape, (*batch, 1, 1)."""
    return np.arange(math.prod(batch), dtype=np.int64).reshape(*batch, 1, 1)


def user_mods(score_mod, score_mod_grad, mask_mod, mod_args, backward: bool = False) -> UserMods | None:
    """The checked ``UserMods`` of a call's keywords (None without any), the arrays of ``mod_args`` as
    NumPy arrays. Raises ``TypeError`` / ``ValueError`` naming the keyword."""
    if score_mod is None and score_mod_grad is None and mask_mod is None:
        if mod_args is not None:
            raise ValueError("mod_args is given without a score_mod or mask_mod to read it")
        return None
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad is given without a score_mod")
    if backward and score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward of a score_mod needs score_mod_grad, its derivative by s")
    args, names = {}, {}
    if mod_args is not None and not isinstance(mod_args, dict):
        raise TypeError(f"mod_args must be a dict of names to arrays or numbers, got {type(mod_args).__name__}")
    for name, value in (mod_args or {}).items():
        if not (isinstance(name, str) and name.isidentifier() and name.isascii()) or name in _RESERVED \
                or name in SCORE_NAMES or name.startswith("_") or name.upper() == name:
            raise ValueError(f"mod_args name {name!r} is not free: it must be a C identifier other than "
                             f"s, b, q_idx, kv_idx, args, a keyword or a function of the language, not "
                             f"starting with _ and not all capitals (the kernels' macros)")
        args[name], names[name] = _bound(name, value)
    score = None if score_mod is None else parse(score_mod, {**SCORE_NAMES, **names}, "score_mod")
    grad = None if score_mod_grad is None else parse(score_mod_grad, {**SCORE_NAMES, **names}, "score_mod_grad")
    mask = None if mask_mod is None else parse(mask_mod, {**INDEX_NAMES, **names}, "mask_mod")
    return UserMods(score, grad, mask, args)


def _kind_of(dtype) -> str | None:
    """INT or FLOAT for a dtype of numbers (bool, ints, floats, bfloat16), else None."""
    if dtype.kind in "biu":
        return INT
    return FLOAT if dtype.kind == "f" or dtype.name == "bfloat16" else None


def _bound(name, value):
    """``(value, (kind, is_array))`` of one ``mod_args`` entry: a number as int64 or float64 (a 0-d
    array too), an array as given (a CuPy one stays on its device: never read here)."""
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return np.int64(value), (INT, False)
    if isinstance(value, (float, np.floating)):
        return np.float64(value), (FLOAT, False)
    on_gpu = hasattr(value, "__cuda_array_interface__")
    try:
        array = value if on_gpu else np.asarray(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"mod_args[{name!r}] must be an array or a number, got {type(value).__name__}") from error
    kind = _kind_of(array.dtype)
    if kind is None:
        raise TypeError(f"mod_args[{name!r}] must hold numbers, got dtype {array.dtype}")
    if array.ndim == 0:
        raise ValueError(f"mod_args[{name!r}] is a 0-d array: pass a number, or a 1-element array read as "
                         f"{name}[0]")
    return array, (kind, True)


# the C type a kernel reads a mod_args array of each dtype as (others are converted to float32 or int64)
GPU_ARRAY_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long", "bool": "bool"}
MAX_ARGS = 8   # UserArgs' slots


@dataclass(frozen=True)
class UserCode:
    """A call's expressions as one kernel specialisation compiles them: the CUDA text of ``score``,
    ``grad``, ``mask`` (None where not given) in the kernel's real type, and ``args``, the declarations
    of the mod_args names from UserArgs' slots (score_mod.cuh)."""
    score: str | None
    grad: str | None
    mask: str | None
    args: str
    mask_by_entry: bool = False    # mask_mod reads b: its tile map differs from batch entry to entry
    mask_reads_arrays: bool = False   # ... or reads a mod_args array: a map is not kept from call to call

    def defines(self) -> tuple[str, ...]:
        """NVRTC ``-D`` options: FLASH_USER_SCORE, FLASH_USER_GRAD, FLASH_USER_MASK, FLASH_USER_ARGS."""
        out = [f"-DFLASH_USER_{name}={text}" for name, text in
               (("SCORE", self.score), ("GRAD", self.grad), ("MASK", self.mask)) if text is not None]
        return (*out, f"-DFLASH_USER_ARGS={self.args}")


def user_code(user: UserMods, real: str, array_types: dict, fast: bool = False) -> UserCode:
    """The ``UserCode`` of ``user`` for kernels computing in ``real`` ("float" or "double"), its arrays
    read as ``array_types`` (name: a value of GPU_ARRAY_TYPES) in the order of ``user.args``; ``fast``:
    score_mod and mask_mod rendered for the kernels of 16-bit inputs (``Expr.render``), score_mod_grad with
    their division but C's functions."""
    if len(user.args) > MAX_ARGS:
        raise ExprError(f"mod_args holds {len(user.args)} names; the kernels take at most {MAX_ARGS}")
    decls = []
    for slot, (name, value) in enumerate(user.args.items()):
        if name in array_types:
            ctype = array_types[name]
            decls.append(f"const {ctype}* {name} = (const {ctype}*)args.slot[{slot}];")
        elif isinstance(value, np.floating):
            decls.append(f"const {real} {name} = ({real})__longlong_as_double((long long)args.slot[{slot}]);")
        else:
            decls.append(f"const long long {name} = (long long)args.slot[{slot}];")
    mask_names = user.mask.names if user.mask is not None else frozenset()
    # score_mod_grad keeps C's functions: 1 - tanh.approx(x)^2 would lose itself where tanh saturates; its
    # divisions take the reciprocal (2 ulp), hoisted where the divisor is the same for every pair
    return UserCode(*(None if x is None else x.render(real, fast and x is not user.grad, fast)
                      for x in (user.score, user.grad, user.mask)),
                    " ".join(decls), "b" in mask_names, any(name in array_types for name in mask_names))
