"""The run's verdict in pytest's JUnit XML (``--junit``), where CI systems look: a testsuite
property ``distconf_verdict`` always, and for any verdict but ``pass`` one more test case,
``distconf.run::verdict``, in error with the verdict's words, so that an interrupted,
crashed or empty run is never shown green by a CI that reads only the XML."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

from harness.errors import ReportError
from harness.outcome.outputs import write_whole
from harness.outcome.verdict import RunVerdict

_EMPTY = '<testsuites><testsuite name="distconf" tests="0" errors="0" /></testsuites>'


def add_verdict(path: Path, verdict: RunVerdict) -> None:
    """Write ``verdict`` into the JUnit XML file at ``path`` (pytest's ``--junitxml``), or,
    where pytest died before writing one, into a file of its own."""
    try:
        root = ElementTree.parse(path).getroot() if path.exists() else ElementTree.XML(_EMPTY)
    except (OSError, ElementTree.ParseError) as exc:
        raise ReportError(f"JUnit XML {str(path)!r} cannot be read: {exc}") from None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise ReportError(f"JUnit XML {str(path)!r} has no <testsuite>")
    properties = suite.find("properties")
    if properties is None:
        properties = ElementTree.Element("properties")
        suite.insert(0, properties)
    ElementTree.SubElement(properties, "property", name="distconf_verdict", value=verdict.kind)
    if verdict.kind != "pass":
        case = ElementTree.SubElement(suite, "testcase", classname="distconf.run", name="verdict")
        error = ElementTree.SubElement(case, "error", message=verdict.headline)
        error.text = verdict.text
        for counter in ("tests", "errors"):
            suite.set(counter, str(int(suite.get(counter, "0")) + 1))
    # whole or not at all: a run killed while writing must not leave XML a CI cannot parse
    write_whole(path, ElementTree.tostring(root, encoding="unicode", xml_declaration=True))
