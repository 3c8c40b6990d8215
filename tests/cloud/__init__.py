"""Tests of object-store locations and the commit protocol, against a real local S3 server."""
