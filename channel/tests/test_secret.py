"""The shared secret: where it comes from, and the errors for every malformed value."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from executor_channel import Secret, SecretError
from executor_channel._net.secret import MIN_SECRET_BYTES

GOOD_HEX = secrets.token_hex(MIN_SECRET_BYTES)


def write_secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_generate_is_random_and_long_enough() -> None:
    first, second = Secret.generate(), Secret.generate()
    assert len(first.key) == MIN_SECRET_BYTES
    assert first != second
    assert first.fingerprint != second.fingerprint


def test_repr_hides_the_key() -> None:
    secret = Secret.generate()
    assert secret.hex() not in repr(secret)
    assert secret.fingerprint in repr(secret)


def test_env_round_trip() -> None:
    secret = Secret.generate()
    assert Secret.load(secret.to_env()) == secret


def test_hex_with_surrounding_whitespace() -> None:
    assert Secret.load({Secret.ENV: f"  {GOOD_HEX}\n"}).hex() == GOOD_HEX


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("zz" * MIN_SECRET_BYTES, "not hex"),
        ("abc", "not hex"),  # odd length
        ("ab" * (MIN_SECRET_BYTES - 1), f"must be at least {MIN_SECRET_BYTES} bytes"),
    ],
)
def test_malformed_env_value(value: str, message: str) -> None:
    with pytest.raises(SecretError, match=message) as info:
        Secret.load({Secret.ENV: value})
    assert Secret.ENV in str(info.value)
    assert value.strip() == "" or value not in str(info.value)  # never echo a secret back


def test_short_key_refused() -> None:
    with pytest.raises(SecretError, match="token_hex"):
        Secret(b"too short")


def test_both_variables_refused(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "secret", GOOD_HEX)
    with pytest.raises(SecretError, match="set only one"):
        Secret.load({Secret.ENV: GOOD_HEX, Secret.ENV_FILE: str(path)})


def test_nothing_set() -> None:
    with pytest.raises(SecretError, match=Secret.ENV):
        Secret.load({})
    assert len(Secret.load({}, generate=True).key) == MIN_SECRET_BYTES


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(Secret.ENV_FILE, raising=False)
    monkeypatch.setenv(Secret.ENV, GOOD_HEX)
    assert Secret.load().hex() == GOOD_HEX


def test_file(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "secret", GOOD_HEX + "\n")
    assert Secret.load({Secret.ENV_FILE: str(path)}).hex() == GOOD_HEX
    assert Secret.from_file(path).hex() == GOOD_HEX


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o666])
def test_file_readable_by_others_refused(tmp_path: Path, mode: int) -> None:
    path = write_secret(tmp_path / "secret", GOOD_HEX, mode)
    with pytest.raises(SecretError, match="chmod 600") as info:
        Secret.load({Secret.ENV_FILE: str(path)})
    assert f"{mode:o}" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="cannot open"):
        Secret.load({Secret.ENV_FILE: str(tmp_path / "absent")})


def test_empty_path() -> None:
    with pytest.raises(SecretError, match="empty"):
        Secret.load({Secret.ENV_FILE: " "})


def test_directory_refused(tmp_path: Path) -> None:
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(SecretError, match="not a regular file"):
        Secret.from_file(directory)


def test_binary_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(MIN_SECRET_BYTES) + b"\xff")
    path.chmod(0o600)
    with pytest.raises(SecretError, match=r"not text|not hex"):
        Secret.from_file(path)


def test_large_file_refused(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "secret", "ab" * 100_000)
    with pytest.raises(SecretError, match="larger than"):
        Secret.from_file(path)


def test_file_with_short_secret(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "secret", "abcd")
    with pytest.raises(SecretError, match=f"at least {MIN_SECRET_BYTES} bytes") as info:
        Secret.from_file(path)
    assert str(path) in str(info.value)
