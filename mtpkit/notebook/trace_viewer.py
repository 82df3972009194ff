"""The debug viewer: a shape trace as a table, filtered by function and dimension."""

from mtpkit.shapes import DIMS, ShapeTrace


class TraceViewer:
    """Dropdowns for the function and a dimension (with a value), over the trace's HTML
    table; `widget` is what to display. Filtering is ShapeTrace.filter."""

    def __init__(self, trace: ShapeTrace, last: int = 200):
        import ipywidgets as widgets

        self.trace, self.last = trace, last
        functions = sorted({e.function for e in trace})
        dims = sorted({k for e in trace for k in e.dims}, key=lambda d: list(DIMS).index(d))
        self.function = widgets.Dropdown(options=["(all)"] + functions, description="function")
        self.dim = widgets.Dropdown(options=["(any)"] + dims, description="dimension")
        self.value = widgets.Text(placeholder="value (blank: bound)", description="=")
        self.table = widgets.HTML()
        for w in (self.function, self.dim, self.value):
            w.observe(lambda _change: self.redraw(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.function, self.dim, self.value]), self.table])
        self.widget.add_class("mtp-trace-viewer")
        self.redraw()

    def filtered(self) -> ShapeTrace:
        function = None if self.function.value == "(all)" else self.function.value
        dims = {}
        if self.dim.value != "(any)":
            v = self.value.value.strip()
            dims[self.dim.value] = int(v) if v.lstrip("-").isdigit() else True
        return self.trace.filter(function, **dims)

    def redraw(self) -> None:
        t = self.filtered()
        shown = f" (last {self.last} shown)" if len(t) > self.last else ""
        self.table.value = (f"<div style='font-size:11px'>{len(t)} of {len(self.trace)} calls{shown}</div>"
                            + t.html(last=self.last))
