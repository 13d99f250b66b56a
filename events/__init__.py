"""The domain of compactor: events, the session log, the context view, tokens, config.

Nothing in this package knows about Redis, HTTP or RQ.
"""
