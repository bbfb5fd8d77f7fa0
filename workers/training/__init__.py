"""One rank's training: the loop (loop), its checkpoints written beside the steps (writer) and read
back at a resume (reader), the checkpoint directory's layout that the control plane reads too
(checkpoints), and the final model written once to final/ (artifacts).

May import: workers.config, workers.limits, workers.records, workers.memory, workers.zero, workers.models,
workers.data.
"""
