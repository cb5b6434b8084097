"""What a run compares on: its numerics arms, its prompts as token ids, and their
boundary-aligned lengths (ab, kld, needle, consistency and engines share them)."""
