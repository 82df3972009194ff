"""Rich (HTML) displays, registered from above.

Objects low in the layout (shape errors and traces, request outputs and their stats) offer
Jupyter's `_repr_html_` through `HTMLRepr`, but the HTML is the notebook package's to write:
`mtpkit.notebook.html` registers a renderer for each kind when mtpkit is imported. So nothing
below the notebook imports it, and a kind with no renderer has no HTML (Jupyter shows repr).
"""

from typing import Callable, ClassVar

_RENDERERS: dict[str, Callable[..., str]] = {}


def register_html(kind: str, render: Callable[..., str]) -> None:
    """render(obj, **kwargs) -> HTML for objects of this kind."""
    _RENDERERS[kind] = render


def render_html(kind: str, obj, **kwargs) -> str | None:
    render = _RENDERERS.get(kind)
    return None if render is None else render(obj, **kwargs)


class HTMLRepr:
    """Mixin: `_repr_html_` through the renderer registered for `html_kind`."""

    html_kind: ClassVar[str]

    def _repr_html_(self) -> str | None:
        return render_html(self.html_kind, self)
