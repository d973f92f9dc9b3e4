"""The S3 test server's wrapper (finetune_devcluster.s3server): what a failed start says, and that it stops."""

from __future__ import annotations

from pathlib import Path

import pytest
from finetune_devcluster import s3server


def test_a_failed_start_names_the_log_and_leaves_no_server(tmp_path: Path) -> None:
    s3server.install()  # a no-op when cached (the s3 fixture's tests install it at collection)
    server = s3server.S3Server(tmp_path)
    with pytest.raises(s3server.S3ServerError, match=rf"creating bucket 'x!' .*HTTP 400; log: {tmp_path}/moto_server.log"):
        server.start(buckets=["x!"])  # not a valid bucket name
    assert server._proc is None and "PUT /x! " in server.logfile.read_text()


def test_env_is_the_standard_aws_client_environment(tmp_path: Path) -> None:
    server = s3server.S3Server(tmp_path)
    server.port = 4321
    assert server.env == {"AWS_ENDPOINT_URL": "http://127.0.0.1:4321", "AWS_ACCESS_KEY_ID": s3server.ACCESS_KEY_ID,
                          "AWS_SECRET_ACCESS_KEY": s3server.SECRET_ACCESS_KEY, "AWS_REGION": "us-east-1"}
