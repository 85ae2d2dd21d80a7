"""The contract suite: every behaviour of docs/SPEC against every backend x mode."""
