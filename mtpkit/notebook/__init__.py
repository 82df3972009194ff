"""mtpkit in Jupyter: the streaming view (`watch`), the debug viewer (`TraceViewer`) and the
HTML of the rich displays. Needs ipywidgets (the `notebook` extra) for the widgets only;
outside a notebook `watch` prints plain text."""

from mtpkit.notebook import view
from mtpkit.notebook.trace_viewer import TraceViewer
from mtpkit.notebook.view import SpecView, in_notebook, stats_line, watch

__all__ = ["watch", "SpecView", "TraceViewer", "in_notebook", "stats_line", "view"]
