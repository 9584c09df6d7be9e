"""Asynchronous parameter-server training for Lightning (``trainer=ps``).

``layout`` says who serves and which server holds which parameter; ``link`` is a worker's two-process
gloo connection to one server; ``server`` turns pushes into updates; ``serve`` runs a server's threads;
``client`` is a worker's side (and its push-pull optimizer); ``coordination`` holds what the ranks share
through the rendezvous store; ``strategy`` is the Lightning strategy.
"""
