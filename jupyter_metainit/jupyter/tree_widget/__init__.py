"""The parts of the model tree widget (``jupyter/widget.py``), one job each: what the page may
change (``page_trust``), the actions and their worker thread (``actions``), following the model
(``following``), the devices offered (``device_fit``) and what the widget says (``wording``).
"""
