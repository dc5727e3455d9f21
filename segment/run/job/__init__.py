"""The ``segment`` job: plan, stages, files, run files, torchrun shards, the folder lock."""
