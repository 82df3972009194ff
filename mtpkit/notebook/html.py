"""HTML for notebooks: tokens coloured by origin, acceptance bars, the shape trace, shape errors.

Plain strings with inline styles (no plotting library, no stylesheet to load), so they render
the same in JupyterLab, VS Code, a static nbconvert export and an ipywidgets HTML widget.
Every token is a `<span class="mtp-tok">` with `data-step` / `data-draft` attributes: the
browser check and the notebook tests read the origins back from them.
"""

import html

from mtpkit.display import register_html
from mtpkit.text.detokenize import IncrementalDetokenizer

# Background of a token by origin: index 0 is the target's own token, j an accepted draft of
# position j (positions past the palette reuse its last colour).
DRAFT_COLOURS = ["#e8e8e8", "#b7e4c7", "#a9d6f5", "#f9d49b", "#f4b6c2", "#d7c4f2", "#c9e7a7", "#f2e49b",
                 "#b8ede6"]
BAR_COLOUR = "#3c8d5a"


def draft_colour(position: int) -> str:
    return DRAFT_COLOURS[min(position, len(DRAFT_COLOURS) - 1)]


def origin_name(position: int) -> str:
    return "target token" if position == 0 else f"accepted draft, position {position}"


def token_pieces(tokenizer, token_ids: list[int], final: bool = True) -> list[str]:
    """Each token's share of the decoded text. A character split over tokens (bytes of one
    UTF-8 character) belongs to the token that completes it; the pieces join to the text.
    final=False (a request still running) holds back a trailing incomplete character."""
    if tokenizer is None:
        return [f"[{t}]" for t in token_ids]
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.add([t], final=final and i == len(token_ids) - 1) for i, t in enumerate(token_ids)]


MAX_HOVER_TOP = 5   # tokens listed in a token's hover text


def logprob_hover(token: int, entry: dict | None) -> tuple[str, str]:
    """(hover text, data attributes) of one token's {token_id: Logprob} entry (SamplingParams.logprobs):
    its logprob and rank, then the likeliest tokens with theirs."""
    if not entry or token not in entry:
        return "", ""
    own = entry[token]
    # the sampled token's entry is first; the others are the top-N by rank (the token may be among them)
    ranked = sorted(((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[0])
    alts = ", ".join(f"{lp.decoded_token if lp.decoded_token is not None else t!r}: {lp.logprob:.3f}"
                     for _, t, lp in ranked[:MAX_HOVER_TOP] if len(entry) > 1)
    text = f" · logprob {own.logprob:.3f} (rank {own.rank})" + (f" · top: {alts}" if alts else "")
    return text, f' data-logprob="{own.logprob:.6g}" data-rank="{own.rank}"'


def token_spans(token_ids: list[int], pieces: list[str], steps: list[int], drafts: list[int],
                logprobs: list | None = None) -> str:
    """One span per token, coloured by origin; hover shows step, origin and token id, and with
    logprobs (one {token_id: Logprob} per token) its logprob, rank and the likeliest tokens."""
    out = []
    entries = logprobs if logprobs is not None else [None] * len(token_ids)
    for t, piece, step, pos, entry in zip(token_ids, pieces, steps, drafts, entries):
        lp_text, lp_attrs = logprob_hover(t, entry)
        title = html.escape(f"step {step} · {origin_name(pos)} · token {t}{lp_text}", quote=True)
        out.append(f'<span class="mtp-tok" data-step="{step}" data-draft="{pos}"{lp_attrs} title="{title}" '
                   f'style="background:{draft_colour(pos)};border-radius:2px">{html.escape(piece)}</span>')
    return "".join(out)


def legend(num_spec: int) -> str:
    items = [(0, "target (after a rejection / bonus)")] + [(j, f"draft {j}") for j in range(1, num_spec + 1)]
    return " ".join(f'<span style="background:{draft_colour(j)};padding:0 4px;border-radius:2px">{label}</span>'
                    for j, label in items)


def text_block(prompt: str, body: str) -> str:
    return ('<pre class="mtp-text" style="white-space:pre-wrap;margin:0;font-size:12px;line-height:1.5">'
            f'<span style="color:#888">{html.escape(prompt)}</span>{body}</pre>')


def request_output_html(out, prompt: str = "") -> str:
    """RequestOutput as coloured tokens, with its finish reason and acceptance."""
    tok = getattr(out, "tokenizer", None)
    pieces = token_pieces(tok, out.token_ids, final=out.finished)
    if tok is not None and not prompt and out.prompt_token_ids:
        prompt = tok.decode(out.prompt_token_ids)
    steps = out.token_steps or [0] * len(out.token_ids)   # error outputs carry no origins
    drafts = out.token_draft_positions or [0] * len(out.token_ids)
    s = out.spec_stats
    head = (f'<div style="font-size:11px;color:#555">request {out.request_id} · {len(out.token_ids)} tokens · '
            f'{out.finish_reason} · {out.num_accepted_tokens} from accepted drafts'
            + (f" · {out.num_cached_tokens} prompt tokens from the prefix cache"
               if getattr(out, "num_cached_tokens", 0) else "")
            + (f" · mean acceptance length {s.mean_acceptance_length:.2f}" if s.verify_steps else "")
            + (f' · <b>error</b>: {html.escape(out.error)}' if out.error else "") + "</div>")
    return (f'<div class="mtp-output">{head}'
            f'{text_block(prompt, token_spans(out.token_ids, pieces, steps, drafts, out.logprobs))}</div>')


def acceptance_bars(stats, title: str = "acceptance per draft position") -> str:
    """SpecStats as an inline bar chart: one bar per draft position, its acceptance rate."""
    rates = stats.acceptance_rate_per_position
    acc = stats.accepted_per_position + [0] * (len(rates) - len(stats.accepted_per_position))
    dra = stats.drafted_per_position + [0] * (len(rates) - len(stats.drafted_per_position))
    rows = []
    for j, (r, a, d) in enumerate(zip(rates, acc, dra), start=1):
        rows.append(
            f'<div class="mtp-bar-row" style="display:flex;align-items:center;gap:6px;font-size:11px">'
            f'<span style="width:52px">draft {j}</span>'
            f'<span style="display:inline-block;width:160px;height:10px;background:#eee">'
            f'<span class="mtp-bar" data-position="{j}" data-rate="{r:.4f}" style="display:block;height:10px;'
            f'width:{100 * r:.1f}%;background:{BAR_COLOUR}"></span></span>'
            f'<span>{r:.2f} ({a}/{d})</span></div>')
    summary = (f"{stats.verify_steps} verify steps · mean acceptance length {stats.mean_acceptance_length:.2f} · "
               f"{stats.num_accepted}/{stats.num_drafted} drafts accepted")
    if not rates:
        summary += " (no drafts: num_spec=0)"
    return (f'<div class="mtp-stats"><div style="font-size:11px;color:#555">{title}: {summary}</div>'
            + "".join(rows) + "</div>")


def trace_table(entries, leading=("num_reqs", "num_reqs_padded", "bundle")) -> str:
    """Shape-trace entries as a table: function, the leading dims, every other bound dim, and
    the arguments' shapes and dtypes."""
    entries = list(entries)
    if not entries:
        return "<i>(shape trace is empty)</i>"
    others = sorted({k for e in entries for k in e.dims} - set(leading))
    cols = list(leading) + others
    th = "".join(f'<th style="text-align:left;padding:1px 6px">{c}</th>'
                 for c in ["#", "function", *cols, "arguments (shape dtype)"])
    body = []
    for i, e in enumerate(entries):
        cells = [str(i), f"<code>{html.escape(e.function)}</code>"]
        cells += [str(e.dims[c]) if c in e.dims else "" for c in cols]
        cells.append("<br>".join(f"{html.escape(k)}: {html.escape(v)}" for k, v in e.args.items()))
        body.append("<tr>" + "".join(f'<td style="text-align:left;padding:1px 6px;vertical-align:top">{c}</td>'
                                     for c in cells) + "</tr>")
    return (f'<table class="mtp-trace" style="font-size:11px;border-collapse:collapse"><thead><tr>{th}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def shape_error_html(err) -> str:
    """ShapeError: the boundary, the bindings made before the conflict, the argument."""
    binds = " ".join(f"<code>{html.escape(k)}={v}</code>" for k, v in err.bindings.items()) or "(none)"
    rows = [("boundary", f"<code>{html.escape(err.boundary)}</code>"),
            ("bindings already made", binds),
            ("conflicting argument", f"<code>{html.escape(err.argument or '?')}</code>"),
            ("its value", html.escape(err.actual or "")),
            ("expected", html.escape(err.expected or ""))]
    table = "".join(f'<tr><th style="text-align:left;padding:1px 8px">{k}</th><td style="text-align:left">{v}</td></tr>'
                    for k, v in rows)
    return (f'<div class="mtp-shape-error" style="border-left:3px solid #c0392b;padding-left:8px">'
            f'<b>ShapeError</b><table style="font-size:12px">{table}</table>'
            f'<details><summary>full message</summary><pre>{html.escape(str(err))}</pre></details></div>')


def register() -> None:
    """The HTML of the library's rich displays (mtpkit.display), registered when mtpkit is imported."""
    register_html("request_output", request_output_html)
    register_html("spec_stats", acceptance_bars)
    register_html("trace_table", trace_table)
    register_html("shape_error", shape_error_html)


register()
