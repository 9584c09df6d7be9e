"""Every relative link in the README and docs/ points at a file or folder of the repository."""

from __future__ import annotations

import re

import pytest

from tests.helpers.config import ROOT
from tests.helpers.docs import DOCUMENTS

pytestmark = pytest.mark.fast

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target); images too


def relative_links(document):
    """(line number, target without its #anchor) of each link that is not a URL or an in-page anchor."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), document.read_text(), flags=re.S | re.M)
    for number, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            if not re.match(r"[a-z]+:|#", target):
                yield number, target.split("#")[0]


def test_relative_links_resolve():
    broken = [f"{doc.relative_to(ROOT)}:{n}: {target}" for doc in DOCUMENTS for n, target in relative_links(doc)
              if not (doc.parent / target).exists()]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_finder_sees_the_links():
    found = {target for n, target in relative_links(ROOT / "README.md")}
    assert any(t.startswith("docs/") for t in found), found  # the README points into docs/
