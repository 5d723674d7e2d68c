"""Fixtures: a real Kafka-compatible broker (tansu) on 127.0.0.1."""

import urllib.request

import pytest

from _broker import Broker
from _s3 import S3Server


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """One in-memory broker for the session; tests use their own topics."""
    process = Broker(tmp_path_factory.mktemp("tansu") / "broker.log")
    yield process
    process.stop()


@pytest.fixture
def persistent_broker(tmp_path):
    """A broker whose log survives restarts (S3 storage in this process)."""
    s3 = S3Server()
    urllib.request.urlopen(
        urllib.request.Request(f"{s3.endpoint}/tansu", method="PUT"))
    process = Broker(tmp_path / "broker.log", storage="s3://tansu/", env={
        "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT": s3.endpoint,
        "AWS_ALLOW_HTTP": "true"})
    yield process
    process.stop()
    s3.close()
