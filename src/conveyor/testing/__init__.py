"""Helpers for testing conveyor and code that uses it: several hosts on one machine (:mod:`.hosts`), where a test
suite's CPU goes (:mod:`.cpu_profile`)."""
