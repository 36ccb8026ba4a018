"""The calculator tool: arithmetic on numbers, evaluated from the syntax tree (never `eval`).

`expression` may hold numbers, + - * / // % **, unary signs and parentheses; nothing else
parses (names, calls, attributes, strings, comparisons). Bounds keep a call cheap whatever
the policy writes: the expression's length (`max_length`), the exponent (`max_exponent`)
and the size of every intermediate result (`max_digits` digits). Integers stay exact;
a result that is a whole number prints without a fraction (8 / 2 -> 4).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rlhf.tools.base import Tool, ToolResult

BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed arithmetic (the message says why)."""


class Calculator(Tool):
    """Settings: max_length (200), max_exponent (64), max_digits (64)."""

    def __init__(self, schema: dict[str, Any], settings: dict[str, Any]):
        super().__init__(schema, settings)
        unknown = set(settings) - {"max_length", "max_exponent", "max_digits"}
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}")
        self.max_length = int(settings.get("max_length", 200))
        self.max_exponent = int(settings.get("max_exponent", 64))
        self.max_digits = int(settings.get("max_digits", 64))

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        expression = str(arguments.get("expression", ""))
        try:
            return ToolResult(format_number(self.evaluate(expression)))
        except CalculatorError as e:
            return ToolResult.failed(str(e))

    def evaluate(self, expression: str) -> int | float:
        """The value of `expression`; CalculatorError when it is not allowed arithmetic."""
        if len(expression) > self.max_length:
            raise CalculatorError(f"the expression is longer than {self.max_length} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise CalculatorError(f"cannot parse {expression!r}") from None
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            if isinstance(node.value, bool):
                raise CalculatorError(f"only numbers are allowed, not {_describe(node)}")
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](self._value(node.operand))  # type: ignore[operator]
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise CalculatorError(f"exponents are limited to {self.max_exponent}")
            try:
                result = BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("the result is too large") from None
            if isinstance(result, complex):
                raise CalculatorError("the result is not a real number")
            return self._bounded(result)
        raise CalculatorError(
            f"only numbers and + - * / // % ** ( ) are allowed, not {_describe(node)}"
        )

    def _bounded(self, value: int | float) -> int | float:
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        size = abs(value)
        if size and math.log10(size) >= self.max_digits:
            raise CalculatorError(f"results are limited to {self.max_digits} digits")
        return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return type(node).__name__


def format_number(value: int | float) -> str:
    """An int as it is; a float without a fraction as an int; other floats to 12 significant
    digits (repr-like, no float noise such as 0.30000000000000004)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.12g}"
