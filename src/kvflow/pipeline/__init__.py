"""Pipeline-parallel restoration (DESIGN.md §2.1, GPU dimension; docs/PIPELINE.md): the model's layers split
into stages that are separate processes on torch.distributed, each restoring its own KV shard from its own pool
reader — independently, from stored boundary activations — then the query flows stage to stage.

    with shared_pool("1G", chunk_tokens=256) as cfg:
        pool = KVPool.open(cfg)
        Restorer(runner, pool, cost=cost).store(context, boundaries=[8])
        pipe = Pipeline("llama-3.2-1b", runner.fingerprint, cfg, cost)
        [res] = pipe.run([PipelineRun(context, query, stages=[(0, 8), (8, 16)])])
        res.logits, res.ttft_s, res.stages[1].restore_s
"""

from kvflow.pipeline.launcher import Pipeline, PipelineResult, PipelineRun, StageReport
from kvflow.pipeline.storage import boundary_overhead, link_bandwidths, shared_pool

__all__ = ["Pipeline", "PipelineResult", "PipelineRun", "StageReport", "boundary_overhead", "link_bandwidths",
           "shared_pool"]
