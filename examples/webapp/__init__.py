"""Warehouse inbound: a Flask-SQLAlchemy app that records a delivery and announces it.

``create_app`` (examples/webapp/app.py) is its factory: ``flask --app examples.webapp.app``.
"""
