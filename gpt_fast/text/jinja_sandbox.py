"""A Jinja sandbox that bounds what rendering a template may cost in memory and time.

Chat templates come with downloaded checkpoints. Jinja's ``ImmutableSandboxedEnvironment`` keeps a template away from
Python internals and from changing its inputs, and caps ``range()`` at 100,000 items, but a template can still ask
for ``'x' * 10**10``, ``10 ** (10 ** 10)`` or loops nested to 10**10 iterations. This environment adds:

- sizes: a string holds at most :data:`MAX_TEXT` characters, a list or dict at most that many items and characters
  through its nesting. What multiplies sizes (``*``, ``+``, ``%``, ``~``, ``str.format``, ``join``, ``replace``,
  padding and indenting) is checked before it runs; other values a call, filter or literal makes, after. Integers
  stay under :data:`MAX_INT_BITS` bits.
- work: each loop iteration, call, filter and operator is a step, and so are each :data:`STEP_CHARS` characters
  made or output and each unit of an integer argument of a filter, string method or ``range`` (a width, a count);
  one render takes at most :data:`MAX_STEPS` steps.
- output: the rendered text holds at most :data:`MAX_TEXT` characters (text that ``{% set %}`` blocks and macros
  capture, at most what :data:`MAX_STEPS` steps can output).

Going past a bound raises ``SecurityError``. Recursion ends at Python's limit (RecursionError).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.runtime import LoopContext, Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

MAX_TEXT = 4 * 2**20  # characters of the rendered text, and of any string, list or dict a template makes
MAX_INT_BITS = 2**16  # bits of any integer a template computes
MAX_STEPS = 1_000_000  # steps of work per render: well under a second
STEP_CHARS = 64  # characters made or output that count as one step
CALL_STEPS = 100  # steps a call of a macro or of a recursive loop counts as (about as long as that many iterations)

_steps_left: ContextVar[list[int]] = ContextVar("template_steps_left")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\d*)(?:\.(\d*))?")  # width and precision of a % field
_BRACE_SPEC = re.compile(r"\{[^{}:]*:([^{}]*)\}")  # the format spec of a {} field


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """``template.render(**variables)`` within the bounds of a :class:`BoundedEnvironment`."""
    token = _steps_left.set([MAX_STEPS])
    try:
        pieces: list[str] = []
        length = 0
        for piece in template.generate(**variables):
            length += len(piece)
            if length > MAX_TEXT:
                raise SecurityError(f"the rendered text is longer than {MAX_TEXT:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _steps_left.reset(token)


def charge(steps: int) -> None:
    """Count ``steps`` against the current render (nothing outside one: constants folded at compile time, whose
    sizes are still checked)."""
    left = _steps_left.get(None)
    if left is None:
        return
    left[0] -= steps
    if left[0] < 0:
        raise SecurityError(f"the template takes more than {MAX_STEPS:,} steps of work")


def measure(value: Any, limit: int = MAX_TEXT) -> tuple[int, int]:
    """``(size, depth)`` of a value: the characters of a string; one for a container and for each of its items
    plus their sizes, through nesting (a list holding the same list twice counts it twice); 0 for anything else.
    Counting stops once the size passes ``limit``."""
    if isinstance(value, (str, bytes)):
        return len(value), 0
    sizes: dict[int, tuple[int, int]] = {}  # id of a container -> its (size, depth), for values met again

    def walk(item: Any) -> tuple[int, int]:
        if isinstance(item, (str, bytes)):
            return len(item), 0
        if not isinstance(item, (dict, list, tuple, set, frozenset)):
            return 0, 0
        if id(item) not in sizes:
            size, depth = 1, 1
            for child in (c for pair in item.items() for c in pair) if isinstance(item, dict) else item:
                child_size, child_depth = walk(child)
                size, depth = size + 1 + child_size, max(depth, 1 + child_depth)
                if size > limit:
                    break
            sizes[id(item)] = size, depth
        return sizes[id(item)]

    return walk(value)


def check_size(value: Any, what: str) -> Any:
    """``value``, once its size is counted as work and found within :data:`MAX_TEXT`."""
    size = measure(value)[0]
    charge(1 + size // STEP_CHARS)
    if size > MAX_TEXT:
        raise SecurityError(f"{what} would hold more than {MAX_TEXT:,} characters or items")
    return value


def _require_size(size: int, what: str) -> None:
    if size > MAX_TEXT:
        raise SecurityError(f"{what} would hold more than {MAX_TEXT:,} characters or items")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _charge_ints(values: Iterable[Any]) -> None:
    """Integer arguments (widths, counts) count as that many steps: they bound the loops they drive."""
    charge(1 + sum(abs(value) for value in values if _is_int(value)))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
        if right * (abs(left).bit_length() - 1) > MAX_INT_BITS:
            raise SecurityError(f"a power of {left} to {right} has more than {MAX_INT_BITS:,} bits")
    elif operator == "*" and _is_int(left) and _is_int(right):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
            raise SecurityError(f"a product has more than {MAX_INT_BITS:,} bits")
    elif operator == "*":
        sequence, count = (left, right) if _is_int(right) else (right, left)
        if _is_int(count) and isinstance(sequence, (str, list, tuple)) and count > 0:
            _require_size(measure(sequence)[0] * count, "a repeated string or list")
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _require_size(measure(left)[0] + measure(right)[0], "a concatenation")
    elif operator == "%" and isinstance(left, str):
        check_format(left, right if isinstance(right, tuple) else (right,), {})


def check_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """``fmt % args`` or ``fmt.format(*args, **kwargs)``: widths and precisions count as steps, and each field
    can hold at most all the arguments."""
    numbers = [n for match in _PERCENT_SPEC.finditer(fmt) for n in match.groups() if n]
    numbers += [n for match in _BRACE_SPEC.finditer(fmt) for n in re.findall(r"\d+", match.group(1))]
    charge(1 + sum(int(n) if len(n) <= len(str(MAX_STEPS)) else MAX_STEPS + 1 for n in numbers))
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):  # widths taken from the arguments
        _charge_ints([*args, *kwargs.values()])
    fields = fmt.count("%") + fmt.count("{")
    _require_size(len(fmt) + fields * measure((args, kwargs))[0], "a formatted string")


def _check_str_method(text: str, name: str, args: tuple) -> None:
    """The result size of the string methods that can make a string much longer than ``text``."""
    if name == "expandtabs" and args and _is_int(args[0]):
        _require_size(len(text) + text.count("\t") * args[0], "expandtabs()")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        if len(args) > 2 and _is_int(args[2]) and args[2] >= 0:
            count = min(count, args[2])
        _require_size(len(text) + count * (len(args[1]) - len(args[0])), "replace()")
    elif name == "join" and args and isinstance(args[0], list):
        _require_size(measure(args[0])[0] + len(text) * len(args[0]), "join()")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _require_size(len(text) * max(1, longest), "translate()")


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _check_filter(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """The result size of the filters that can make a value much larger than their input (``args`` and
    ``kwargs`` follow the value)."""
    text = str(value) if name in ("replace", "indent", "wordwrap", "format") else ""
    if name == "replace":
        old, new, count = (_arg(args, kwargs, i, n) for i, n in enumerate(("old", "new", "count")))
        _check_str_method(text, "replace", (str(old), str(new), -1 if count is None else count))
    elif name == "join" and isinstance(value, list):
        separator = str(_arg(args, kwargs, 0, "d", ""))
        _require_size(measure(value)[0] + len(separator) * len(value), "the join filter")
    elif name == "indent":
        width = _arg(args, kwargs, 0, "width", 4)
        width = width if _is_int(width) else len(str(width))
        _require_size(len(text) + (text.count("\n") + 1) * width, "the indent filter")
    elif name == "wordwrap":
        wrapstring = _arg(args, kwargs, 2, "wrapstring")
        _require_size(len(text) * max(1, len(str(wrapstring or ""))), "the wordwrap filter")
    elif name == "format":
        check_format(text, args, kwargs)
    elif name == "sum" and isinstance(value, list) and isinstance(_arg(args, kwargs, 1, "start"), (str, list, tuple)):
        _require_size(len(value) * measure(value)[0], "the sum filter")  # adding sequences one by one
    elif name == "pprint":
        charge(measure(value)[0])  # pretty-printing walks the value in Python


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with its work counted and its result size checked; an iterable it consumes is made a list first
    where its size matters (join, sum)."""
    first = 1 if hasattr(func, "jinja_pass_arg") else 0  # jinja passes the context or environment first

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if name in ("join", "sum") and len(args) > first and not isinstance(args[first], (str, dict)):
            args = (*args[:first], list(args[first]), *args[first + 1 :])
        _charge_ints([*args[first + 1 :], *kwargs.values()])
        _check_filter(name, args[first] if len(args) > first else None, args[first + 1 :], kwargs)
        return check_size(func(*args, **kwargs), f"the {name} filter")

    return bounded


def bounded_json(value: Any, indent: int | str | None = None, **options: Any) -> str:
    """``json.dumps(value, indent=indent, **options)`` within the bounds: the indentation of the deepest line
    counts as steps, and the text stops at :data:`MAX_TEXT` characters."""
    if indent is not None:
        width = indent if _is_int(indent) else len(str(indent))
        charge(width * measure(value)[1])
    pieces: list[str] = []
    length = 0
    for piece in json.JSONEncoder(indent=indent, **options).iterencode(value):
        length += len(piece)
        _require_size(length, "the JSON text")
        pieces.append(piece)
    return check_size("".join(pieces), "the JSON text")


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with hooks where sandbox methods do not reach: each loop's items, ``~``
    concatenation, list/tuple/dict literals and output go through methods of :class:`BoundedEnvironment`."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        items = nodes.EnvironmentAttribute("loop_items", lineno=node.iter.lineno)
        node.iter = nodes.Call(items, [node.iter], [], None, None, lineno=node.iter.lineno)
        node.iter.set_environment(self.environment)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_text((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("), context.eval_ctx.autoescape)")

    def _checked(self, visit: Callable[[Any, Frame], None], node: nodes.Expr, frame: Frame) -> None:
        self.write("environment.checked_literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._checked(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._checked(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "load":
            self._checked(super().visit_Tuple, node, frame)
        else:  # an assignment target
            super().visit_Tuple(node, frame)

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.output_text(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        return f"environment.output_text({super()._output_const_repr(group)})"


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose templates' memory and work are bounded (see the module docstring). Render with
    :func:`render_bounded`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(
        self, *, extra_filters: dict[str, Callable[..., Any]], extra_globals: dict[str, Any], **options: Any
    ) -> None:
        super().__init__(**options)
        self.filters.update(extra_filters)
        self.filters = {name: _bounded_filter(name, func) for name, func in self.filters.items()}
        self.globals.update(extra_globals, range=_bounded_range)
        self.globals.pop("lipsum", None)  # paragraphs of filler text: not for prompts

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        charge(1)
        _check_binop(operator, left, right)
        return check_size(super().call_binop(context, operator, left, right), f"the {operator} operator")

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__name__", type(obj).__name__)
        if isinstance(owner, str):
            if name == "join" and args and not isinstance(args[0], list):
                args = (list(args[0]), *args[1:])
            _charge_ints([*args, *kwargs.values()])
            _check_str_method(owner, name, (*args, *kwargs.values()))
        else:
            charge(CALL_STEPS if isinstance(obj, (Macro, LoopContext)) else 1)
        return check_size(super().call(context, obj, *args, **kwargs), f"{name}()")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        fmt = value.__self__

        @functools.wraps(formatter)
        def bounded(*args: Any, **kwargs: Any) -> str:
            check_format(fmt, args, kwargs)
            return check_size(formatter(*args, **kwargs), "str.format()")

        return bounded

    def loop_items(self, items: Any) -> Iterator[Any]:
        for item in items:
            charge(1)
            yield item

    def concat_text(self, values: tuple[Any, ...], autoescape: bool) -> str:
        _require_size(sum(measure(value)[0] for value in values), "the ~ operator")
        return check_size((markup_join if autoescape else str_join)(values), "the ~ operator")

    def checked_literal(self, value: Any) -> Any:
        return check_size(value, "a literal")

    def output_text(self, text: str) -> str:
        charge(1 + len(text) // STEP_CHARS)
        return text


def _bounded_range(*args: int) -> range:
    """Jinja's sandboxed ``range`` (at most 100,000 items), its length counted as steps."""
    charge(1 + len(range(*args)))
    return safe_range(*args)
