"""Functions the task YAMLs in `tasks/` call (`!function resadapt_eval.tasks.<module>.<fn>`)."""
