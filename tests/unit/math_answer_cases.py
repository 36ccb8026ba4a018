r"""Hard cases of MATH-style answer equivalence: (boxed answer, ground truth, equal?, kind).

Each verdict is a mathematician's, written from the mathematics, not from running a checker:
equal when the two denote the same value, set, interval, tuple, matrix or equation, with the
conventions of the MATH dataset (units, `\text{}`, `$`, degree signs and `\%` are decoration
of a number; `1,000` is one thousand; a list of solutions is a set). Approximations are not
equal to the exact value (`0.33` is not 1/3, `3.14` is not pi).
"""

from __future__ import annotations

CASES: list[tuple[str, str, bool, str]] = [
    # fractions
    (r"\frac{1}{2}", "0.5", True, "fraction vs decimal"),
    (r"\dfrac{3}{4}", r"\frac{3}{4}", True, "dfrac"),
    (r"\tfrac34", r"\frac{3}{4}", True, "tfrac, braces omitted"),
    (r"\frac12", r"\frac{1}{2}", True, "braces omitted"),
    ("3/4", r"\frac{3}{4}", True, "slash fraction"),
    (r"\frac{2}{4}", r"\frac{1}{2}", True, "unreduced fraction"),
    (r"-\frac{3}{4}", r"\frac{-3}{4}", True, "sign outside vs inside"),
    (r"\frac{1}{3}", "0.33", False, "rounded decimal is not the fraction"),
    (r"\frac{1}{2}", "2", False, "reciprocal"),
    (".5", "0.5", True, "leading zero omitted"),
    # LaTeX wrappers and decoration
    (r"\left( 3, -4 \right)", "(3,-4)", True, r"\left \right"),
    (r"\$18.90", "18.9", True, "dollar sign, trailing zero"),
    (r"5\text{ cm}", "5", True, "unit in text"),
    (r"10 \text{ inches}", "10", True, "unit in text, space"),
    (r"90^\circ", "90", True, "degrees"),
    (r"30^{\circ}", "30", True, "degrees, braced"),
    (r"25\%", "25", True, "percent sign"),
    (r"\text{(C)}", "(C)", True, "choice in text"),
    (r"\text{even}", r"\text{odd}", False, "different words"),
    (r"\mathrm{even}", r"\text{even}", True, "mathrm vs text"),
    # numbers
    ("1,000", "1000", True, "thousands comma"),
    ("10,000", "10000", True, "thousands comma"),
    ("-5", "5", False, "sign"),
    ("-5", "-5", True, "negative"),
    ("12", "21", False, "digits swapped"),
    (r"1.5 \times 10^{3}", "1500", True, "scientific notation"),
    (r"6.02 \times 10^{23}", r"6.02 \cdot 10^{23}", True, r"\times vs \cdot"),
    (r"2^{10}", "1024", True, "power"),
    # roots, pi, other functions
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True, "rationalised denominator"),
    (r"2\sqrt{3}", r"\sqrt{12}", True, "simplified root"),
    (r"\sqrt2", r"\sqrt{2}", True, "braces omitted"),
    (r"\sqrt{3}", "3", False, "root vs radicand"),
    (r"\sqrt{2}", "1.414", False, "approximation of a root"),
    (r"\sqrt[3]{8}", "2", True, "cube root"),
    (r"\pi/2", r"\frac{\pi}{2}", True, "pi over 2"),
    ("3.14", r"\pi", False, "approximation of pi"),
    (r"2\pi", r"\pi", False, "multiple of pi"),
    (r"\log_2 8", "3", True, "logarithm"),
    (r"\binom{5}{2}", "10", True, "binomial coefficient"),
    ("5!", "120", True, "factorial"),
    (r"\infty", r"\infty", True, "infinity"),
    (r"-\infty", r"\infty", False, "signed infinity"),
    # expressions and equations
    (r"x^2 + 2x + 1", r"(x+1)^2", True, "expanded polynomial"),
    (r"\frac{x}{2}", "0.5x", True, "coefficient forms"),
    ("x = 3", "3", True, "assignment vs value"),
    ("x = 3", "4", False, "wrong assignment"),
    ("y = 2x + 1", "y=2x+1", True, "equation spacing"),
    # intervals
    ("[2, 5)", "[2,5)", True, "half-open interval"),
    ("(2, 5]", "[2,5)", False, "other half open"),
    ("[1,2]", "(1,2)", False, "closed vs open"),
    (r"\left[ 2, 5 \right)", "[2,5)", True, r"\left[ \right)"),
    (r"(-\infty, 0) \cup (1, \infty)", r"(1,\infty) \cup (-\infty,0)", True, "union order"),
    # sets and tuples
    (r"\{1, 2, 3\}", r"\{3, 2, 1\}", True, "set order"),
    (r"\{1, 2\}", r"\{1, 2, 3\}", False, "missing element"),
    ("1, 2", "2, 1", True, "list of solutions in any order"),
    ("(1, 2)", "(2, 1)", False, "ordered pair swapped"),
    # matrices and vectors
    (
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
        True,
        "matrix spacing",
    ),
    (
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        r"\begin{pmatrix}1&2\\4&3\end{pmatrix}",
        False,
        "matrix entries swapped",
    ),
    (
        r"\begin{pmatrix} 2 \\ -1 \end{pmatrix}",
        r"\begin{pmatrix}2\\-1\end{pmatrix}",
        True,
        "vector",
    ),
    # complex numbers
    ("1 + i", "i + 1", True, "complex, order"),
    ("2i", "2", False, "imaginary vs real"),
]
