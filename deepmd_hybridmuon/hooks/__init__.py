"""Modules named by this package's entry points.

deepmd-kit imports an entry point's target (``metadata.EntryPoint.load``) and does not
call it, so each module here does its work when imported, and nothing else imports them.
"""
