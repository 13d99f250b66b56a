from compactor.urls import redacted


def test_password_is_hidden_and_the_rest_kept() -> None:
    assert redacted("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted("rediss://user:s3cret@host/1") == "rediss://user:***@host/1"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"
    assert redacted("unix:///tmp/r.sock?db=0") == "unix:///tmp/r.sock?db=0"
