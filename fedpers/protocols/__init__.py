"""Protocols: one module per algorithm, each a :class:`~fedpers.protocols.base.Protocol`."""

from fedpers.protocols.base import Message, Protocol, StatSpec, Verdict, verify_message

__all__ = ["Message", "Protocol", "StatSpec", "Verdict", "verify_message"]
