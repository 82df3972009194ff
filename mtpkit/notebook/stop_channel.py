"""Delivering the Stop button's click while the cell running `watch` blocks the kernel.

A kernel runs a cell's code on its main thread and handles the frontend's widget messages
there too, after the cell. ipykernel >= 7 has subshells (JEP 91): threads of their own that
handle shell messages, and a comm whose `_reply_subshell_id` names a subshell has its
messages routed there. The Stop button's comm is routed to one subshell per kernel, so its
click is handled while the cell runs; the handler only sets a flag, and `watch` aborts the
requests on the main thread between steps (the engine is not thread-safe). Older kernels use
jupyter-ui-poll, which handles pending messages between steps; with neither, the click
arrives only after the cell.
"""

import contextlib

_subshell_id: str | None = None


def route_to_subshell(widget) -> bool:
    """Route `widget`'s messages to this module's subshell; False where that is not possible."""
    global _subshell_id
    try:
        from IPython import get_ipython

        kernel = get_ipython().kernel
        if not getattr(kernel, "_supports_kernel_subshells", False):
            return False
        if _subshell_id is None:
            # What the control thread does for a create_subshell_request (ipykernel 7).
            sock = kernel.shell_channel_thread.manager.control_to_shell_channel.from_socket
            sock.send_json({"type": "create"})
            reply = sock.recv_json()
            if reply.get("status") != "ok":
                return False
            _subshell_id = reply["subshell_id"]
        widget.comm._reply_subshell_id = _subshell_id
        return True
    except Exception:  # another kernel, or its internals moved: fall back to polling
        return False


def ui_poll():
    """A context whose value, called between steps, handles pending widget messages
    (jupyter-ui-poll), or does nothing."""
    try:
        from jupyter_ui_poll import ui_events
    except ImportError:
        return contextlib.nullcontext(lambda n: None)
    return ui_events()
