"""What a run checks and prepares before its actors start: its inputs, the checkpoint it resumes from, its output
directory."""
