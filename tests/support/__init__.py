"""Helpers the tests share (graph builders, the independent checker, rank workers, session-wide traces): imported
as ``tests.support.<module>``; no tests here."""
