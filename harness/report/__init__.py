"""The HTML report of distconf results: ``render_report(results, output)``.

Self-contained (inline CSS and SVG, no scripts, no network), rendered from results files
only. Data shaping lives in ``records`` (reading), ``model`` (summary, matrix, failures),
``parity`` (error metrics and their chart) and ``compare`` (a baseline run); ``render``
lays it out with the templates of ``templates/``. ``reach`` measures which DTensor ops the
run reached (``python -m harness reach``, and a line of the report); ``surface`` which options
of torch's public API its tests drew (``python -m harness surface``, and a line of the
report), ``surface_refused`` the options a spec declares out of scope.
"""

from harness.errors import ReportError
from harness.report.render import build_page, render_report

__all__ = ["ReportError", "build_page", "render_report"]
