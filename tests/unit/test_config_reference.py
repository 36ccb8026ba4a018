"""docs/config-reference.md is what the schema says (rlhf.config.reference): a key added,
renamed or re-documented without regenerating the page fails here."""

from __future__ import annotations

from rlhf.config.loader import all_keys
from rlhf.config.reference import reference
from tests.helpers import REPO


def test_the_config_reference_is_the_schemas():
    page = (REPO / "docs" / "config-reference.md").read_text()
    assert page == reference(), "run: python -m rlhf.config.reference > docs/config-reference.md"
    for key in all_keys():
        assert f"| `{key}` |" in page, key
