"""The fuzz: a live job takes every attack issue 11 reported, then random, truncated and lying messages
(docs/contributors.md, The fuzz). Test support code: tests/test_fuzz.py runs it at CI size, and
`PYTHONPATH=tests python -m fuzz --messages 100000 --epochs 40` at full size (bench/RESULTS.md, section 6).

attacks.py holds the reported attacks, messages.py the random messages (both pure), run.py the jobs and checks.
"""
