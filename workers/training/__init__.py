"""One rank's training: the loop (loop), which steps it checkpoints and what a stop writes (checkpointer),
its checkpoints written beside the steps (writer) and read back at a resume (reader), the checkpoint
directory's layout that the control plane reads too (checkpoints), the final model written once to
final/ (artifacts), where it all is stored (storage), the one walk by which a trusted process opens any
path inside a job's storage or a child's home (confined), a dataset's objects on a store staged for a
child to read (staging), a job's code bundle unpacked for its child alone (bundles), and another job's
final weights loaded to start from (init_weights).

May import: workers.config, workers.limits, workers.records, workers.health, workers.phases, workers.uris,
workers.memory, workers.zero, workers.models, workers.data.
"""
