"""The bounded sandbox renders as Jinja's own immutable sandbox does, and refuses what would cost too much."""

from __future__ import annotations

import tracemalloc

import jinja2.ext
import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpt_fast.text.jinja_sandbox import MAX_TEXT, BoundedEnvironment, measure, render_bounded

OPTIONS = {"trim_blocks": True, "lstrip_blocks": True, "extensions": [jinja2.ext.loopcontrols]}
MESSAGES = [{"role": "user", "content": "  Hello, wide world!  "}, {"role": "assistant", "content": "Hi.\tThere"}]

# Loops (plain, unpacking, else, recursive, filtered, with loop controls and loop.*), macros, literals, operators,
# captured blocks, filters and string methods: all rendered as Jinja's own sandbox renders them.
ORDINARY_TEMPLATES = [
    "{% for m in messages %}{{ m.role | upper }}: {{ m.content | trim | replace('o', '0') }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}",
    "{{ messages | map(attribute='content') | join(', ') }} {{ ', '.join(['a', 'b']) }}",
    "{{ '%s=%d' % ('x', 3) }} {{ '{}-{:>5}'.format('a', 'b') }} {{ 'ab' * 3 }} {{ 3 * [0] }} {{ 2 ** 10 }}"
    " {{ [1, 2] + [3] }} {{ 'a' ~ 1 ~ none }} {{ (1, 2) }} {{ {'k': [1]} }} {{ 7 // 2 }} {{ -2 ** 2 }}",
    "{% macro m(x) %}<{{ x }}>{% endmacro %}{% for i in range(3) %}{{ m(i) }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}{% endfor %}"
    "{{ ns.n }}",
    "{{ 'x' | center(9) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'long text here' | wordwrap(5) }}"
    "|{{ [3, 1, 2] | sort | list }}|{{ range(5) | batch(2) | list }}|{{ {'b': 1, 'a': 2} | dictsort }}"
    "|{{ [1, 2, 3] | sum }}|{{ [[1], [2]] | sum(start=[]) }}|{{ '%s!' | format(5) }}|{{ 'a\tb'.expandtabs(4) }}"
    "|{{ 'abc'.center(7, '*') }}|{{ 'a-b'.replace('-', '+') }}|{{ [1, 2] | pprint }}",
    "{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% else %}none{% endfor %}"
    "{% for x in [] %}{% else %}empty{% endfor %}",
    "{% for x in [[1, [2]], [3]] recursive %}[{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}]"
    "{% endfor %}",
    "{% set t %}captured {{ 1 + 1 }}{% endset %}{{ t }}{% filter upper %}shout{% endfilter %}",
    "{{ messages[0]['content'][1:5] }} {{ (messages | first).role }} {{ messages | length }}"
    " {{ messages | selectattr('role', 'equalto', 'user') | list | length }}",
    "{% for i in range(10) if i != 3 %}{% if i is odd %}{% continue %}{% endif %}{% if i > 6 %}{% break %}"
    "{% endif %}{{ i }}{{ loop.index }}/{{ loop.length }}{% endfor %}",
    "{% for c in 'abc' %}{{ loop.revindex }}{{ c }}{{ loop.cycle('+', '-') }}{% endfor %}",
    "{% autoescape true %}{{ '<b>' ~ messages[0].content }}{{ '&' }}{% endautoescape %}{{ '<i>' ~ 1 }}",
]


def bounded(template: str) -> str:
    env = BoundedEnvironment(extra_filters={}, extra_globals={}, **OPTIONS)
    return render_bounded(env.from_string(template), {"messages": MESSAGES})


@pytest.mark.parametrize("template", ORDINARY_TEMPLATES)
def test_ordinary_templates_render_as_in_jinjas_sandbox(template: str) -> None:
    expected = ImmutableSandboxedEnvironment(**OPTIONS).from_string(template).render(messages=MESSAGES)
    assert bounded(template) == expected


LONG = f"'x' * {MAX_TEXT // 2}"

HOSTILE_TEMPLATES = {
    "repeat": ("{{ 'x' * 10**10 }}", "a repeated string or list would hold more than"),
    "repeat-list": ("{{ [1, 2] * 10**9 }}", "a repeated string or list"),
    "power": ("{{ 10 ** (10 ** 10) }}", "a power of 10 to 10000000000 has more than 65,536 bits"),
    "squaring": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "a product has more than",
    ),
    "nested-range": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "takes more than 1,000,000 steps",
    ),
    "nested-string-loops": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "exponential-macro": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
        "steps",
    ),
    "doubling-list": (
        "{% set ns = namespace(x=[1]) %}{% for i in range(100) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
        "a literal would hold more than",
    ),
    "doubling-concat": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "the ~ operator would hold more than",
    ),
    "doubling-plus": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "a concatenation would hold more than",
    ),
    "center-method": ("{{ 'x'.center(10**9) }}", "steps"),
    "center-filter": ("{{ 'x' | center(10**9) }}", "steps"),
    "percent-width": ("{{ '%999999999d' % 1 }}", "steps"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "steps"),
    "format-repeat": (f"{{{{ ('{{0}}' * 1000).format({LONG}) }}}}", "a formatted string would hold more than"),
    "replace": (f"{{{{ ({LONG}).replace('x', 'yyy') }}}}", r"replace\(\) would hold more than"),
    "join-method": (f"{{{{ ({LONG}).join(['a', 'b', 'c']) }}}}", r"join\(\) would hold more than"),
    "literal": (f"{{{{ [{LONG}, {LONG}, {LONG}] }}}}", "a literal would hold more than"),
    "join-separator": (f"{{{{ range(9) | join({LONG}) }}}}", "the join filter would hold more than"),
    "indent": (f"{{{{ ('a\\n' * {MAX_TEXT // 4}) | indent(100) }}}}", "the indent filter would hold more than"),
    "tojson-indent": ("{{ [[[[1]]]] | tojson(indent=10**9) }}", "steps"),
    "expandtabs": ("{{ '\\t'.expandtabs(10**9) }}", "steps"),
    "batch-fill": ("{{ [1] | batch(10**9, 'x') | list }}", "steps"),
    "slice": ("{{ range(10) | slice(10**9) | list }}", "steps"),
    "translate": (f"{{{{ ('ab' * 1000).translate({{97: {LONG}}}) }}}}", r"translate\(\) would hold more than"),
    "sum-lists": ("{{ ([[0] * 100] * 1000) | sum(start=[]) }}", "the sum filter would hold more than"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}", "the rendered text is longer than"),
    "range": ("{% for i in range(10**5) %}{% endfor %}" * 11, "steps"),
}


@pytest.mark.parametrize(("template", "message"), HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_costly_templates_are_refused(template: str, message: str) -> None:
    with pytest.raises(SecurityError, match=message):
        bounded(template)


@pytest.mark.parametrize("name", ["repeat", "power", "replace", "format-repeat", "doubling-list", "indent"])
def test_refused_before_the_memory_is_taken(name: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(SecurityError):
            bounded(HOSTILE_TEMPLATES[name][0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_TEXT  # bytes: a few strings of MAX_TEXT / 2 characters, nothing of 10**10


def test_lipsum_is_not_offered() -> None:
    with pytest.raises(jinja2.UndefinedError, match="'lipsum' is undefined"):
        bounded("{{ lipsum(10**6) }}")


def test_measure_counts_shared_values_as_often_as_they_occur() -> None:
    inner = ["ab", 1]
    assert measure(inner) == (1 + (1 + 2) + (1 + 0), 1)
    assert measure([inner, inner, {"k": inner}]) == (1 + 2 * (1 + 5) + (1 + (1 + (1 + 1) + (1 + 5))), 3)
    deep: list = [1]
    for _ in range(200):
        deep = [deep, deep]
    assert measure(deep, limit=10**6)[0] > 10**6  # 2**200 items, counted in 200 steps
