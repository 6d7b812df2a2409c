"""Show how one step's batch is split across PCP ranks (DualChunkSwap layout).

Each prompt (minus its cached tokens) is cut into 2P chunks and rank k
computes chunks k and 2P-1-k; decodes are computed by every rank. The view
lists every rank's rows (which chunk of which request, at which positions), its
token count and causal attention work (sum of position + 1), and the imbalance
of that work (max rank / mean rank).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctxpar.checks import check_int
from ctxpar.errors import CtxparError
from ctxpar.parallel.pcp import chunk_offsets, plan_pcp_layout
from ctxpar.parallel.pcp_layout import PCPLayout

BAR_WIDTH = 40
MAX_POSITION = (1 << 31) - 1  # far beyond any model's context; keeps attention work (sum of position + 1) in int64
MAX_PCP = 1024
MAX_STEP_SLOTS = 1 << 24  # ~128 MiB per int64 index map of the layout
MAX_VIEW_LINES = 1 << 17  # one line per row of each rank: beyond this the text view is unreadable and slow
SPREAD_MIN_ROWS = 64  # a fixed example: the engine's own comes from the cost model
MAX_PNG_RANKS = 64  # the figure grows with the ranks: beyond this it exceeds what matplotlib will draw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-lens", type=int, nargs="*", default=[], metavar="N", help="prompt lengths")
    parser.add_argument(
        "--cached",
        type=int,
        nargs="*",
        metavar="N",
        help="tokens of each prompt already in the KV cache (prefix hits, earlier chunks); default 0 each",
    )
    parser.add_argument("--decodes", type=int, default=0, help="number of decoding requests (1 token each)")
    parser.add_argument("--decode-context", type=int, default=1000, help="tokens cached for each decode")
    parser.add_argument("--pcp", type=int, default=2, help="number of PCP ranks")
    parser.add_argument(
        "--replicate-below",
        type=int,
        default=0,
        metavar="N",
        help="replicate prompts computing fewer than N tokens instead of splitting them",
    )
    parser.add_argument(
        "--spread-min-rows",
        type=int,
        default=SPREAD_MIN_ROWS,
        metavar="N",
        help="give unsplit rows (decodes, short prompts) to one rank each in steps that split a prompt or "
        f"have at least N of them, as the engine does (default: {SPREAD_MIN_ROWS}; the engine derives its own "
        "from the cost model: ctxpar generate --verbose prints it)",
    )
    parser.add_argument("--png", metavar="FILE", help="also draw the layout to this PNG file (needs matplotlib)")


@dataclass(frozen=True)
class Batch:
    scheduled: np.ndarray  # (R,) prompts first, then decodes
    computed: np.ndarray  # (R,)
    prefilling: np.ndarray  # (R,)
    num_prompts: int

    def name(self, req: int) -> str:
        return f"prompt {req}" if req < self.num_prompts else f"decode {req - self.num_prompts}"


def build_batch(args: argparse.Namespace) -> Batch:
    """The batch the arguments describe; CtxparError for values outside the stated limits."""
    for n in args.prompt_lens:
        check_int("--prompt-lens", n, 1, MAX_POSITION)
    cached_lens = [0] * len(args.prompt_lens) if args.cached is None else args.cached
    if len(cached_lens) != len(args.prompt_lens):
        raise CtxparError(
            f"--cached has {len(cached_lens)} values for {len(args.prompt_lens)} --prompt-lens: give one per prompt"
        )
    for c, n in zip(cached_lens, args.prompt_lens):
        if not 0 <= c < n:
            raise CtxparError(
                f"--cached {c} for a prompt of {n} tokens: each --cached value must be >= 0 and below its "
                "prompt length (a step computes >= 1 token)"
            )
    check_int("--decodes", args.decodes, 0, MAX_POSITION)
    check_int("--decode-context", args.decode_context, 1, MAX_POSITION)
    check_int("--pcp", args.pcp, 1, MAX_PCP)
    check_int("--replicate-below", args.replicate_below, 0, MAX_POSITION)
    check_int("--spread-min-rows", args.spread_min_rows, 0)
    if len(args.prompt_lens) + args.decodes == 0:
        raise CtxparError("nothing to plan: give --prompt-lens and/or --decodes")
    # The layout holds int64 index maps over every rank's local tokens: split
    # tokens once in all, replicated ones (decodes, short prompts) once per rank.
    new = [n - c for n, c in zip(args.prompt_lens, cached_lens)]
    split = sum(q for q in new if q >= args.replicate_below)
    slots = split + args.pcp * (sum(new) - split + args.decodes)
    if slots > MAX_STEP_SLOTS:
        raise CtxparError(
            f"this step lays out {slots:,} token slots over {args.pcp} rank(s) (split tokens plus ranks x "
            f"replicated tokens), more than the {MAX_STEP_SLOTS:,} this view handles; a real step holds "
            "max_num_batched_tokens (default 2048) tokens: give fewer or shorter prompts, fewer decodes or ranks"
        )
    lines = args.pcp * (2 * len(new) + args.decodes)  # a split prompt is at most two rows per rank
    if lines > MAX_VIEW_LINES:
        raise CtxparError(
            f"this view would print up to {lines:,} rows ({args.pcp} rank(s) x ({len(new)} prompt(s) x 2 + "
            f"{args.decodes} decode(s))), more than {MAX_VIEW_LINES:,}: give fewer prompts, decodes or ranks"
        )
    prompts = np.array(args.prompt_lens, dtype=np.int64)
    cached = np.array(cached_lens, dtype=np.int64)
    return Batch(
        scheduled=np.concatenate([prompts - cached, np.ones(args.decodes, dtype=np.int64)]),
        computed=np.concatenate([cached, np.full(args.decodes, args.decode_context, dtype=np.int64)]),
        prefilling=np.concatenate([np.ones(len(prompts), dtype=bool), np.zeros(args.decodes, dtype=bool)]),
        num_prompts=len(prompts),
    )


def row_label(batch: Batch, layout: PCPLayout, req: int, start_pos: int, num_tokens: int) -> str:
    """e.g. 'prompt 1  chunk 3', 'prompt 0  chunks 1-2' (rank P-1's merged row),
    'decode 0  replicated', 'decode 1  assigned'."""
    if not layout.is_split[req]:
        return f"{batch.name(req)}  " + ("assigned" if layout.is_assigned[req] else "replicated")
    P = layout.pcp_size
    bounds = chunk_offsets(int(batch.scheduled[req]), P, np.arange(2 * P + 1))
    offset = start_pos - int(batch.computed[req])
    first = int(np.searchsorted(bounds, offset, side="right")) - 1  # skips empty chunks sharing the bound
    last = int(np.searchsorted(bounds, offset + num_tokens, side="left")) - 1
    return f"{batch.name(req)}  " + (f"chunk {first}" if first == last else f"chunks {first}-{last}")


def render_text(batch: Batch, layout: PCPLayout) -> str:
    P, work = layout.pcp_size, layout.attention_work()
    prompt_tokens = int(batch.scheduled[: batch.num_prompts].sum())
    lines = [
        f"PCP layout over {P} rank(s): {batch.num_prompts} prompt(s) computing {prompt_tokens} tokens, "
        f"{len(batch.scheduled) - batch.num_prompts} decode(s); {layout.num_tokens} tokens this step, "
        f"padded to {layout.num_tokens_padded} per rank",
        "",
    ]
    for k in range(P):
        bar = "#" * round(BAR_WIDTH * work[k] / max(work.max(), 1))
        lines.append(f"rank {k}: {layout.per_rank_num_tokens[k]} tokens, attention work {work[k]:,}  {bar}")
        for first_slot, req, start, num in _rows(layout, k):
            if num == 0:
                lines.append("    no tokens (one empty placeholder row)")
                continue
            flat = int(layout.padded_gather_idx[k * layout.num_tokens_padded + first_slot])
            lines.append(
                f"    {row_label(batch, layout, req, start, num):<22} positions {_span(start, num):<13} "
                f"{num:>6} {'tokens' if num > 1 else 'token':<6}   step tokens {_span(flat, num)}"
            )
    lines += [
        "",
        f"tokens per rank: {' '.join(map(str, layout.per_rank_num_tokens.tolist()))}",
        f"attention work imbalance (max/mean, 1.000 = perfect): {work.max() / work.mean():.3f}",
    ]
    return "\n".join(lines)


def _rows(layout: PCPLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """(first local slot, req_idx, start_pos, num_tokens) of each of the rank's rows."""
    rows = layout.rank_rows(rank)
    columns = (rows.query_start_loc[:-1], rows.req_idx, rows.start_pos, rows.num_tokens)
    return list(zip(*(c.tolist() for c in columns)))


def _span(first: int, count: int) -> str:
    return f"{first}-{first + count - 1}" if count > 1 else str(first)


def draw_png(batch: Batch, layout: PCPLayout, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CtxparError("--png needs matplotlib: pip install matplotlib (or pip install 'ctxpar[plot]')") from e
    P, n, work = layout.pcp_size, layout.num_tokens_padded, layout.attention_work()
    fig, (ax_tok, ax_work) = plt.subplots(1, 2, figsize=(12, 1 + 0.6 * P), gridspec_kw={"width_ratios": [3, 1]})
    colors = plt.get_cmap("tab10")
    for k in range(P):
        for first_slot, req, start, num in _rows(layout, k):
            if num == 0:
                continue
            color = colors(req % 10) if req < batch.num_prompts else "0.6"  # decodes in grey
            ax_tok.barh(k, num, left=first_slot, color=color, edgecolor="black", linewidth=0.5)
            if num >= 0.08 * n:  # label only segments wide enough to hold it
                label = row_label(batch, layout, req, start, num).replace("  ", "\n")
                ax_tok.text(first_slot + num / 2, k, label, ha="center", va="center", fontsize=7)
        real = layout.per_rank_num_tokens[k]
        if real < n:
            ax_tok.barh(k, n - real, left=real, color="white", edgecolor="0.7", hatch="//")
    ax_tok.set(
        title="local tokens per rank (hatched: padding)",
        xlabel="local token slot",
        ylabel="rank",
        yticks=range(P),
        xlim=(0, n),
    )
    ax_tok.invert_yaxis()
    ax_work.barh(range(P), work, color="tab:blue")
    ax_work.axvline(work.mean(), color="black", linestyle="--", linewidth=1)
    ax_work.set(
        title=f"attention work, max/mean {work.max() / work.mean():.3f}",
        yticks=range(P),
        xlabel="sum of position + 1 (dashed: mean)",
    )
    ax_work.invert_yaxis()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:  # e.g. no permission: the path was checked to exist beforehand
        raise CtxparError(f"--png {path}: cannot write it: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def check_png_path(args: argparse.Namespace) -> None:
    """Refuse a --png that cannot be written before planning anything."""
    if not args.png:
        return
    folder = Path(args.png).resolve().parent
    if not folder.is_dir():
        raise CtxparError(f"--png {args.png}: the directory {folder} does not exist; create it or pick another path")
    if args.pcp > MAX_PNG_RANKS:
        raise CtxparError(
            f"--png draws at most {MAX_PNG_RANKS} ranks, got --pcp {args.pcp}; drop --png for the text view"
        )


def run(args: argparse.Namespace) -> None:
    batch = build_batch(args)
    check_png_path(args)
    layout = plan_pcp_layout(
        batch.scheduled, batch.computed, batch.prefilling, args.pcp, args.replicate_below, args.spread_min_rows
    )
    print(render_text(batch, layout))
    if args.png:
        draw_png(batch, layout, args.png)
        print(f"\nwrote {args.png}")
