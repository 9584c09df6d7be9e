"""Pipeline parallelism for Lightning on ``torch.distributed.pipelining`` (``trainer=pipeline``).

``partition`` splits a net's named blocks into balanced stages; ``schedule`` builds stages and
schedules by name; ``runner`` runs one batch through them; ``grads`` carries the schedule's
gradients through Lightning's closure; ``mesh`` lays processes out as ``dp x pp``;
``checkpoint`` gathers and scatters full-model state; ``strategy`` is the Lightning strategy.
"""
