"""The contract suite: every behaviour of docs/CONTRACT.md (the user-facing
contract) against every backend x mode; see util.py for the matrix."""
