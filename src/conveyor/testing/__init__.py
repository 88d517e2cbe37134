"""Helpers for testing conveyor and code that uses it: several hosts on one machine (:mod:`.hosts`)."""
