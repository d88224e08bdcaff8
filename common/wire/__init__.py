"""The wire and its schema: the frames, every message type, error codes, the chunk layout and member ids.

A change to a module here is a change to the protocol every role speaks: raise PROTOCOL_VERSION with it
(tests/test_wire_schema.py, where present, says so).
"""
