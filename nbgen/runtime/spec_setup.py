"""``make_spec_stepper``: the SpecStepper an engine's config asks for (None without speculation)."""
from __future__ import annotations

from typing import Optional

from nbgen.core.config import EngineConfig
from nbgen.core.spec_config import SpecConfig
from nbgen.runtime.loop_stats import LoopStats
from nbgen.runtime.runner import ModelRunner
from nbgen.runtime.scheduler import Scheduler
from nbgen.runtime.spec_eagle import make_eagle_drafter
from nbgen.runtime.spec_eagle_batch import EagleChainDrafter
from nbgen.runtime.spec_eagle_tree import EagleTreeDrafter
from nbgen.runtime.spec_draft_model import DraftModelDrafter, make_draft_graphs, make_draft_runner
from nbgen.runtime.spec_ngram import NgramProposer
from nbgen.runtime.spec_step import Drafter, SpecStepper
from nbgen.runtime.spec_tree_step import TreeSpecStepper
from nbgen.runtime.verify_graphs import make_verify_graphs


def make_spec_stepper(runner: ModelRunner, scheduler: Scheduler, cfg: EngineConfig,
                      stats: Optional[LoopStats] = None) -> Optional[SpecStepper]:
    """The loop's speculative stepper for ``cfg.speculative_algorithm`` (NGRAM, STANDALONE, EAGLE, EAGLE3), or None."""
    spec = SpecConfig.of(cfg)
    if spec is None:
        return None
    drafter: Drafter
    if spec.algorithm == "STANDALONE":
        draft = make_draft_runner(cfg, runner.device, runner.num_pages)
        drafter = DraftModelDrafter(draft, runner.vocab_size, spec.num_steps,
                                    make_draft_graphs(draft, spec.num_draft_tokens))
    elif spec.algorithm in ("EAGLE", "EAGLE3"):
        eagle = make_eagle_drafter(cfg, runner, spec.num_steps, spec.algorithm == "EAGLE3")
        if spec.topk > 1:          # tree drafts
            trees = EagleTreeDrafter(runner, eagle.head, spec.num_steps, spec.topk, spec.max_drafts)
            return TreeSpecStepper(runner, scheduler, spec, trees, stats)
        drafter = EagleChainDrafter(runner, eagle.head, spec.num_steps)     # chains batched across requests
    else:
        drafter = NgramProposer(spec.ngram_max_match)
    return SpecStepper(runner, scheduler, spec, drafter, stats,
                       verify_graphs=make_verify_graphs(runner, spec.num_draft_tokens))
