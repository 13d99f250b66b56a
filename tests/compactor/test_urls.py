from compactor.urls import host_port, listening_url, redacted


def test_password_is_hidden_and_the_rest_kept() -> None:
    assert redacted("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted("rediss://user:s3cret@host/1") == "rediss://user:***@host/1"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"
    assert redacted("unix:///tmp/r.sock?db=0") == "unix:///tmp/r.sock?db=0"


def test_a_password_given_as_a_query_parameter_is_hidden_too() -> None:
    """redis-py authenticates with ``?password=``, and every message printed it whole."""
    assert redacted("redis://127.0.0.1:6999/0?password=hunter2") == "redis://127.0.0.1:6999/0?password=***"
    assert redacted("unix:///tmp/r.sock?db=2&Password=p%40ss&socket_timeout=5") == \
        "unix:///tmp/r.sock?db=2&Password=***&socket_timeout=5"
    assert redacted("redis://u:pw@h/0?password=x") == "redis://u:***@h/0?password=***"
    assert redacted("redis://h/0?pass%77ord=s3cret") == "redis://h/0?pass%77ord=***"  # (redis-py decodes the name)


def test_an_ipv6_host_is_bracketed_before_its_port() -> None:
    assert host_port("127.0.0.1", 8080) == "127.0.0.1:8080"
    assert host_port("::1", 8080) == "[::1]:8080"


def test_a_server_on_every_interface_is_named_by_an_address_to_open() -> None:
    """``serve`` in the image (``COMPACTION_API_HOST=0.0.0.0``) announced ``API http://0.0.0.0:8080``."""
    assert listening_url("127.0.0.1", 8080) == "http://127.0.0.1:8080"
    assert listening_url("0.0.0.0", 8080) == "http://127.0.0.1:8080 (listening on all interfaces, 0.0.0.0:8080)"
    assert listening_url("::", 8080) == "http://[::1]:8080 (listening on all interfaces, [::]:8080)"
