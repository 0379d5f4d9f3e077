"""The scheduler's side of speculative decoding (runtime/spec_step.py): pages for a running request's
draft tokens taken without preempting anyone, the accepted drafts appended through the one stop check,
and the pages of rejected drafts given back (torch-free)."""
from __future__ import annotations

from typing import Any, Optional

from nbgen.core.finish import FinishReason
from nbgen.core.request import Request
from nbgen.runtime.pages import PagePool


def reserve_pages(pool: PagePool, req: Request, kv_len: int) -> int:
    """Pages for up to ``kv_len`` tokens of ``req`` from free or evictable pages, never preempting:
    the number of tokens its pages cover now."""
    need = pool.pages_for(kv_len) - len(req.pages)
    new = pool.alloc(need) if need > 0 else None
    req.pages.extend(new or ())
    return len(req.pages) * pool.page_size


def release_tail(pool: PagePool, req: Request) -> None:
    """Free the pages past the request's tokens (those of rejected drafts)."""
    keep = pool.pages_for(req.num_tokens)
    if len(req.pages) > keep:
        pool.unref(req.pages[keep:])
        del req.pages[keep:]          # in place: the page table's identity marks live SeqWorks


def accept_drafts(req: Request, toks: list[int], lps: list[Any], context_length: Optional[int]
                  ) -> Optional[FinishReason]:
    """Append the draft tokens a verify step accepted (before its bonus token), each through the stop
    check; a finish inside the run cuts it there, as plain decoding would have stopped."""
    for tok, lp in zip(toks, lps):
        req.output_ids.append(tok)
        if lp is not None:
            req.add_output_logprob(lp)
        reason = req.end_after(tok, len(req.output_ids), context_length)
        if reason is not None:
            req.num_computed = min(req.num_computed, req.num_tokens)
            return reason
    return None
