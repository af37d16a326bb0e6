"""What the test suite plugs into dsmt, kept out of the product: warm_ranks.py, the session's warm rank servers
(dsmt's launcher reaches them through its generic DSMT_RANK_RUNNER hook, toolkit/launch/local.py)."""
