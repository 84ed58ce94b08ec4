"""What a run writes to disk and reads back: step folders and their commit marker, DCP state,
the portable form, the unpickling guard, and the consolidated export.
"""
