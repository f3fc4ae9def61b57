"""Browser sessions: signed, expiring, tied to the token that logged in, and never the token."""

from __future__ import annotations

import hashlib
import stat

import pytest

from manager.auth.sessions import BrowserSessions, load_or_create_key

TOKEN = "vmt_" + "a" * 43
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
OTHER_DIGEST = hashlib.sha256(b"another token").hexdigest()


@pytest.fixture
def sessions(tmp_path) -> BrowserSessions:
    return BrowserSessions.from_key_file(tmp_path / "session.key")


def test_a_session_is_good_until_it_expires(sessions):
    value = sessions.issue(DIGEST, now=1000)
    assert TOKEN not in value and DIGEST not in value
    assert sessions.is_valid(value, [DIGEST], now=1000 + sessions.lifetime_s - 1)
    assert not sessions.is_valid(value, [DIGEST], now=1000 + sessions.lifetime_s)
    assert BrowserSessions.expires_at(value) == 1000 + sessions.lifetime_s


def test_a_session_ends_when_its_token_is_gone(sessions):
    value = sessions.issue(DIGEST, now=1000)
    assert sessions.is_valid(value, [OTHER_DIGEST, DIGEST], now=1001)
    assert not sessions.is_valid(value, [OTHER_DIGEST], now=1001)
    assert not sessions.is_valid(value, [], now=1001)


def test_changed_or_made_up_values_are_refused(sessions):
    value = sessions.issue(DIGEST, now=1000)
    expires, nonce, mac = value.split(".")
    later = f"{int(expires) + 86400}.{nonce}.{mac}"  # a longer life, without the key
    made_up = (later, f"{expires}.other.{mac}", f"{expires}.{nonce}.{'0' * 64}", f"{expires}.{nonce}.\xe9\udcff",
               f"{expires}.\udcff.{mac}", "", "a.b", "1.2.3.4", TOKEN)  # fmt: skip
    for forged in made_up:
        assert not sessions.is_valid(forged, [DIGEST], now=1001), forged


def test_sessions_survive_a_restart_and_another_key_refuses_them(tmp_path):
    key_file = tmp_path / "session.key"
    value = BrowserSessions.from_key_file(key_file).issue(DIGEST, now=1000)
    assert BrowserSessions.from_key_file(key_file).is_valid(value, [DIGEST], now=1001)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key_file.unlink()  # deleting the key ends every session
    assert not BrowserSessions.from_key_file(key_file).is_valid(value, [DIGEST], now=1001)


def test_a_key_file_too_short_to_be_a_key_is_refused_with_what_to_do(tmp_path):
    key_file = tmp_path / "session.key"
    key_file.write_bytes(b"short")
    with pytest.raises(ValueError, match="delete it"):
        load_or_create_key(key_file)
