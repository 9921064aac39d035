"""The parts of the model tree widget (``jupyter/widget.py``), one job each: what the page may
change (``page_trust``), the actions and their worker thread (``actions.ActionRunner``), the plan
and the other actions' jobs (``plan_actions.PlanState``, ``save_action``, ``values``,
``comparing``), following the model (``following.ModelFollower``), the devices offered
(``device_fit``) and what the widget says (``wording``). What the parts need back from the
widget is one typed interface, ``host.WidgetHost``.
"""
